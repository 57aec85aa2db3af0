"""The random stream of one sampler: std::mt19937 seeded as llama.cpp seeds it, with
libstdc++'s uniform draws, so a seed gives the same numbers llama.cpp draws from it."""
from __future__ import annotations

import os

import numpy as np

from .params import RANDOM_SEED

_TWO_32 = 4294967296.0


def resolve_seed(seed: int | None) -> int:
    """None / -1 / 0xFFFFFFFF mean "random" (as LLAMA_DEFAULT_SEED does): draw one from the system."""
    if seed is None or seed in (-1, RANDOM_SEED):
        return int.from_bytes(os.urandom(4), "little") % RANDOM_SEED
    return seed


class Mt19937:
    """The generator is made on the first draw: greedy samplers never draw, and importing
    numpy.random costs a one-shot command ~16 ms of its start."""

    def __init__(self, seed: int):
        self._seed = seed
        self._gen = None

    @property
    def _bits(self):
        if self._gen is None:
            # RandomState's integer seeding is mt19937's init_genrand, the same as std::mt19937(seed)
            self._gen = np.random.MT19937()
            self._gen.state = {"bit_generator": "MT19937",
                               "state": np.random.RandomState(self._seed).get_state(legacy=False)["state"]}
        return self._gen

    def uniform(self) -> float:
        """std::uniform_real_distribution<double>(0, 1): two 32-bit draws, low word first."""
        a, b = self._bits.random_raw(2).tolist()
        u = (a + b * _TWO_32) / (_TWO_32 * _TWO_32)
        return u if u < 1.0 else float(np.nextafter(1.0, 0.0))

    def uniform_f32(self) -> float:
        """std::uniform_real_distribution<float>(0, 1): one 32-bit draw, rounded to float."""
        u = np.float32(self._bits.random_raw()) / np.float32(_TWO_32)
        return float(u) if u < 1 else float(np.nextafter(np.float32(1), np.float32(0)))

    def copy(self) -> Mt19937:
        twin = Mt19937(self._seed)
        if self._gen is not None:  # drawn from already: the twin continues from the same state
            twin._gen = np.random.MT19937()
            twin._gen.state = self._gen.state
        return twin
