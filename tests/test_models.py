"""Both architectures on tiny synthetic GGUF files of every weight type: the CPU backend's
logits against the float64 reference backend, through prefill and decode over a paged,
shuffled KV cache with several sequences in one batch."""
from __future__ import annotations

import numpy as np
import pytest

from ember.backends import AttentionBatch, get_backend
from ember.gguf_loader import GGUFFile
from ember.models import ModelError, Step, load_model
from ember.quant import GGMLType
from synth import ALL_TYPES, Shape, write_model

PAGE = 4
FLOAT_TYPES = {GGMLType.F32, GGMLType.F16, GGMLType.BF16}


class Runner:
    """Drives one model through steps for several sequences with shuffled page tables."""

    def __init__(self, model, n_seq: int, max_len: int, seed: int):
        pages_per_seq = -(-max_len // PAGE)
        perm = np.random.default_rng(seed).permutation(n_seq * pages_per_seq).astype(np.int32)
        self.tables = perm.reshape(n_seq, pages_per_seq)
        self.model, self.cache = model, model.new_kv_cache(n_seq * pages_per_seq, PAGE)
        self.lengths = [0] * n_seq

    def step(self, tokens_per_seq: list[list[int]]) -> np.ndarray:
        toks, pos, rows = [], [], []
        for s, toks_s in enumerate(tokens_per_seq):
            toks += toks_s
            pos += range(self.lengths[s], self.lengths[s] + len(toks_s))
            rows += [s] * len(toks_s)
            self.lengths[s] += len(toks_s)
        pos, rows = np.array(pos, np.int32), np.array(rows, np.int32)
        slots = self.tables[rows, pos // PAGE].astype(np.int64) * PAGE + pos % PAGE
        attn = AttentionBatch(pos, rows, self.tables, slots, PAGE)
        step = Step(np.array(toks, np.int32), attn, np.arange(len(toks), dtype=np.int32))
        return np.array(self.model.forward(step, self.cache), np.float64)  # a copy: logits are reused


def run_script(model, seed: int = 1) -> list[np.ndarray]:
    """Prefill two sequences of different lengths together, then decode both a few steps."""
    rng = np.random.default_rng(seed)
    n_vocab = model.n_vocab
    r = Runner(model, n_seq=2, max_len=40, seed=seed)
    outs = [r.step([list(rng.integers(0, n_vocab, 13)), list(rng.integers(0, n_vocab, 7))])]
    for _ in range(3):
        outs.append(r.step([[int(rng.integers(n_vocab))], [int(rng.integers(n_vocab))]]))
    outs.append(r.step([list(rng.integers(0, n_vocab, 9)), [int(rng.integers(n_vocab))]]))
    return outs


@pytest.fixture(scope="module")
def backends():
    return get_backend("cpu", threads=2), get_backend("reference")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_cpu_matches_reference(tmp_path, backends, arch, qtype):
    shape = Shape(n_layer=6 if arch == "gemma3" else 2)  # gemma3: five local layers, then a global one
    path = write_model(tmp_path / "m.gguf", arch, qtype, shape, tied=qtype != GGMLType.Q8_0)
    with GGUFFile(path) as f:
        cpu, ref = (load_model(f, b) for b in backends)
        for got, want in zip(run_script(cpu), run_script(ref)):
            err = np.abs(got - want).max() / np.abs(want).max()
            # f16 KV cache everywhere; 8-bit activations for quantized weights
            assert err < (2e-4 if qtype in FLOAT_TYPES else 1.5e-2), f"relative error {err:.2e}"
            assert (got.argmax(1) == want.argmax(1)).mean() >= 0.9


def test_sliding_window_changes_the_result(tmp_path, backends):
    """Beyond the window, local layers must not see old tokens: a narrower window gives other logits."""
    outs = []
    for window in (4, 64):
        path = write_model(tmp_path / f"w{window}.gguf", "gemma3", GGMLType.F16, Shape(n_layer=6), window=window)
        with GGUFFile(path) as f:
            outs.append(run_script(load_model(f, backends[1]))[-1])
    assert np.abs(outs[0] - outs[1]).max() > 1e-3


def test_missing_tensor_is_a_clear_error(tmp_path, backends):
    import gguf

    path = tmp_path / "broken.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((10, 32), np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFFile(path) as f, pytest.raises(ModelError, match="blk.0.attn_norm.weight"):
        load_model(f, backends[0])


def test_unknown_architecture(tmp_path, backends):
    import gguf

    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "nonesuch")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFFile(path) as f, pytest.raises(ModelError, match="nonesuch"):
        load_model(f, backends[0])
