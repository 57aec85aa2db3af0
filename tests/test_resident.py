"""Weight matrices moved in place onto huge pages (ember/backends/cpu/resident.py), on the real models."""
from __future__ import annotations

import gc
import os
import threading

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


# ---- stacked experts: moved as the kernels first use them ----

WIDE_EXPERTS = dict(n_expert=16, n_used=2, d_ff_exp=16384)  # each expert 2.3-3.4 MB: its own 2 MB stretches


@pytest.fixture(scope="module")
def wide_moe(tmp_path_factory):
    """A one-layer qwen3moe file whose experts span whole huge pages (150 MB, most of it experts)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from families import write_family
    return write_family(tmp_path_factory.mktemp("moe") / "wide-moe.gguf", "qwen3moe", n_layer=1, sizes=WIDE_EXPERTS)


def resident_bytes(lo: int, hi: int) -> int:
    """Resident bytes of this process's memory in [lo, hi) (/proc/self/smaps, whole mappings inside it)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                a, b = (int(v, 16) for v in head.split("-"))
                inside = lo <= a and b <= hi
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def used_stretches(settler) -> set[int]:
    return set().union(*(s.chunks(np.flatnonzero(s.used)) for s in settler._stacks if s.ref() is not None))


def test_used_experts_move_and_nothing_else(wide_moe):
    """Greedy tokens from the mapping and from huge pages agree; afterwards the used experts' stretches
    are anonymous memory with the file's bytes, the others still the file's, and the resident memory of
    the file's range is what was read (rounded to 2 MB), not the file."""
    from ember.engine import LLM
    from ember.sampler import SamplingParams

    greedy = SamplingParams(temperature=0, ignore_eos=True)
    llm = LLM(str(wide_moe), device="cpu", threads=2, ctx=64)
    fd = os.open(wide_moe, os.O_RDONLY)
    try:
        settler = llm.backend._settler
        assert settler.wait(60) and settler.moved_experts == 0  # nothing used yet: nothing moved
        before = llm.generate([1, 2, 3], 3, greedy).token_ids
        assert settler.wait(60) and settler.error is None
        stretches = used_stretches(settler)
        assert 0 < settler.moved_experts <= len(stretches) * HUGE
        assert all(0 < s.used.sum() < WIDE_EXPERTS["n_expert"] // 2 for s in settler._stacks)  # a few of them
        for c in stretches:
            assert mapping_kind(c) == "" and mapping_kind(c + HUGE - 1) == ""
        for s in settler._stacks:  # an unused expert that shares no stretch with a moved one stays mapped
            for e in np.flatnonzero(s.used == 0):
                own = s.chunks([e])
                if not own & settler._on_huge:
                    assert all(mapping_kind(c) != "" for c in own)
        tensors = list(llm.gguf.tensors.values())  # views of the model's own mapping
        whole = tensors[0].mapped_file()
        base, size = whole.ctypes.data, whole.nbytes
        del whole
        dense = sum(t.nbytes for t in tensors if len(t.shape) < 3)
        bound = len(stretches) * HUGE + dense + (4 << 20)  # 4 MB: the kernel maps file pages 64 KB at a time
        assert resident_bytes(base, base + size) <= bound < size
        for t in tensors:  # the bytes the kernels read, moved or not, are the file's
            assert bytes(t.data) == os.pread(fd, t.nbytes, t.offset), t.name
        assert llm.generate([1, 2, 3], 3, greedy).token_ids == before
    finally:
        os.close(fd)
        llm.close()


def test_closing_while_experts_move_is_safe(wide_moe):
    """A model closed and dropped right after its first step, while its experts move: the pass holds
    the mapping until it is done, and the thread ends once the model's stacks are gone."""
    from ember.engine import LLM
    from ember.sampler import SamplingParams

    for _ in range(3):
        llm = LLM(str(wide_moe), device="cpu", threads=1, ctx=64)
        settler = llm.backend._settler
        llm.generate([1, 2], 1, SamplingParams(temperature=0, ignore_eos=True))
        settler.wait(0)  # a pass starts now
        llm.close()
        del llm
        gc.collect()
        assert settler.wait(30) and settler.error is None
        for _ in range(100):
            if not settler.running():
                break
            threading.Event().wait(0.1)
        assert not settler.running()
    assert np.float32(1) + np.float32(1) == 2
