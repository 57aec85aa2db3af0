"""Weight matrices moved in place onto huge pages (ember/backends/cpu/resident.py), on the real models."""
from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from ember.backends.cpu import Backend
from ember.backends.cpu.resident import HUGE, Settler
from ember.gguf_loader import GGUFFile
from ember.models import load_model

pytestmark = pytest.mark.skipif(not Settler.usable(), reason="no transparent huge pages (or not Linux)")


def mapping_kind(addr: int) -> str:
    """The path of the mapping that holds addr in /proc/self/maps ('' for anonymous memory)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if lo <= addr < hi:
                return fields[5] if len(fields) > 5 else ""
    raise AssertionError(f"{addr:#x} is not mapped")


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_matrices_move_in_place_with_their_bytes(model_path, name):
    path = model_path(name)
    fd = os.open(path, os.O_RDONLY)
    backend = Backend(threads=2)
    try:
        with GGUFFile(path) as g:
            model = load_model(g, backend)
            settler = backend._settler
            assert settler.wait(120) and settler.error is None
            runs = settler.runs()
            assert runs and settler.moved == sum(hi - lo for lo, hi in runs)
            whole = next(iter(g.tensors.values())).mapped_file()
            base = whole.ctypes.data
            for lo, hi in runs:  # 2 MB-aligned stretches inside the file's mapping
                assert lo % HUGE == 0 and hi % HUGE == 0 and base <= lo < hi <= base + whole.nbytes
                assert mapping_kind(lo) == "" and mapping_kind(hi - 1) == ""  # now anonymous memory
            # every tensor reads the file's bytes, moved or not
            for t in g.tensors.values():
                assert bytes(t.data) == os.pread(fd, t.nbytes, t.offset), t.name
            # an untied embedding table is read in part: left mapped (SmolLM2 and Gemma 3 tie theirs)
            assert ("output.weight" in g.tensors) or any(lo <= model.tok_embd.data.ctypes.data < hi for lo, hi in runs)
    finally:
        os.close(fd)


def test_greedy_tokens_are_the_same_before_and_after_the_move(model_path):
    """Generation right after loading (the mapping, or part moved) and once the move is done give
    the same greedy tokens; the recorded decode steps keep their addresses throughout."""
    from ember.engine import LLM
    from ember.sampler import SamplingParams

    greedy = SamplingParams(temperature=0, ignore_eos=True)
    llm = LLM(model_path("smollm2"), device="cpu", threads=2, ctx=256)
    try:
        before = llm.generate("The capital of France is", 24, greedy).token_ids
        assert llm.backend.settled(120) and llm.backend._settler.moved > 0
        assert llm.generate("The capital of France is", 24, greedy).token_ids == before
    finally:
        llm.close()


def test_closing_while_moving_is_safe(model_path):
    """A model dropped right after loading: the move holds the mapping until it is done."""
    for _ in range(3):
        backend = Backend(threads=1)
        g = GGUFFile(model_path("gemma3-270m"))
        model = load_model(g, backend)
        settler = backend._settler
        del model
        g.close()
        gc.collect()
        assert settler.wait(120)
        assert settler.error is None
    assert np.float32(1) + np.float32(1) == 2
