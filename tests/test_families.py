"""Every decoder family on its synthetic GGUF file (tests/families.py: SmolLM2's vocabulary, a
Q4_K_M-style mix, peaked distributions) against llama.cpp's log-probabilities stored in
tests/data/families (tests/make_family_data.py), and the CPU backend against the float64
reference backend through prefill and decode over a shuffled paged cache."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import DATA
from families import FAMILIES, write_family
from test_models import run_script

from ember.backends import get_backend
from ember.engine import LLM
from ember.engine.scoring import chunk_logits, chunks_of, collect_reduced
from ember.gguf_loader import GGUFFile
from ember.models import ModelError, load_model

NAMES = sorted(FAMILIES)
MAX_MEAN_KLD = 0.01
MIN_SAME_TOP = 0.98
CLEAR_MARGIN = 0.3


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory):
    out = tmp_path_factory.mktemp("families")
    return {name: write_family(out / f"{name}.gguf", name) for name in NAMES}


def base_data(name: str) -> dict:
    with np.load(DATA / "families" / f"{name}.npz") as z:
        return {k: z[k] for k in z.files}


def ember_log_probs(path, device: str, data: dict) -> np.ndarray:
    """(positions, n_vocab) log-probabilities of the stored chunks' scored positions."""
    n_ctx = int(data["n_ctx"])
    with LLM(path, device=device, threads=2, ctx=n_ctx) as llm:
        rows = []
        for chunk in chunks_of(llm, data["tokens"].tolist(), n_ctx):
            rows.append(np.concatenate(collect_reduced(chunk_logits(llm, chunk, n_ctx // 2))))
    z = np.concatenate(rows).astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def kld_top(base_ids: np.ndarray, base_logp: np.ndarray, logq: np.ndarray) -> np.ndarray:
    """KL divergence per position over the base's stored best ids plus the rest of the vocabulary as
    one outcome (a lower bound of the full divergence, within 1e-4 of it on these peaked rows)."""
    p = np.exp(base_logp.astype(np.float64))
    q_top = np.take_along_axis(logq, base_ids, axis=1)
    rest_p = np.clip(1 - p.sum(axis=1), 1e-12, None)
    rest_q = np.clip(1 - np.exp(q_top).sum(axis=1), 1e-12, None)
    return (p * (base_logp - q_top)).sum(axis=1) + rest_p * np.log(rest_p / rest_q)


@pytest.mark.parametrize("name", NAMES)
def test_kl_divergence_against_llama_cpp(synthetic, name):
    data = base_data(name)
    logq = ember_log_probs(synthetic[name], "cpu", data)
    kld = kld_top(data["ids"], data["logp"], logq)
    same = logq.argmax(axis=1) == data["ids"][:, 0]
    ok = np.ones(len(kld), bool)
    ok[data["far"]] = False  # llama.cpp far from the float64 reference there: checked below
    assert ok.mean() >= 0.97, f"llama.cpp is far from the reference at {len(data['far'])} positions"
    assert kld[ok].mean() <= MAX_MEAN_KLD, f"mean KLD {kld[ok].mean():.5f}"
    assert same[ok].mean() >= MIN_SAME_TOP, f"same top {same[ok].mean():.3f}"


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_as_llama_cpp(synthetic, name):
    """32 greedy tokens equal to llama-server's up to its first step with a top-2 margin under 0.3."""
    from ember.sampler import SamplingParams

    data = base_data(name)
    want = data["greedy_ids"].tolist()
    upto = next((i for i, m in enumerate(data["greedy_margin"]) if m < CLEAR_MARGIN), len(want))
    with LLM(synthetic[name], threads=2, ctx=256) as llm:
        out = llm.generate(data["greedy_prompt"].tolist(), max_tokens=upto, sampling=SamplingParams.greedy_params())
    assert out.token_ids[:upto] == want[:upto]


@pytest.mark.parametrize("name", [n for n in NAMES if len(base_data(n)["far"])])
def test_where_llama_cpp_is_far_from_float64_ember_lands_where_llama_cpp_does(synthetic, name):
    """Ill-conditioned positions: llama.cpp's 8-bit activations move them by > 0.5 nats (up to ~57)
    from the float64 reference. The CPU backend rounds activations as llama.cpp does in files with
    K-quants, so it lands with llama.cpp, not with float64."""
    data = base_data(name)
    far = data["far"]
    cpu = ember_log_probs(synthetic[name], "cpu", data)[far]
    ref = ember_log_probs(synthetic[name], "reference", data)[far]
    kld = kld_top(data["ids"][far], data["logp"][far], cpu)
    assert kld.max() <= 0.01, f"CPU against llama.cpp at {far.tolist()}: KLD {kld.round(4).tolist()}"
    assert ((np.exp(ref) * (ref - cpu)).sum(axis=1) > 0.5).all()  # and these positions are far from float64


@pytest.fixture(scope="module")
def backends():
    return get_backend("cpu", threads=2), get_backend("reference")


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64) - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def assert_follows_reference(backend, ref, path, f16: bool, rows_move: bool = False) -> None:
    """Logits of run_script (prefill and decode over a shuffled paged cache) against float64. F16
    weights: only float rounding and the f16 KV cache differ, so the structure must hold to 2e-3.
    The K-quant mix rounds activations to 8 bits as llama.cpp does, and some of these random
    positions are ill-conditioned (they move as llama.cpp's do: tests above), so there the bound is
    on each row's KL divergence and the argmax. Where rows_move, one row in ten may move more: in a
    mixture of experts a token whose router logits of two experts lie within that rounding of each
    other takes the other expert (llama.cpp's does too), which moves its row and the rows after it
    wholesale; a backend's own rounding may move an ill-conditioned row (the caller says which)."""
    rows = []
    with GGUFFile(path) as f:
        for got, want in zip(run_script(load_model(f, backend)), run_script(load_model(f, ref))):
            if f16:
                err = np.abs(got - want).max() / np.abs(want).max()
                assert err < 2e-3, f"relative error {err:.2e}"
                assert (got.argmax(1) == want.argmax(1)).mean() >= 0.9
                continue
            lw, lg = log_softmax(want), log_softmax(got)
            kld = (np.exp(lw) * (lw - lg)).sum(axis=1)
            rows.append(np.stack([kld, got.argmax(1) == want.argmax(1)], axis=1))
            if not rows_move:
                assert kld.max() < 0.25 and kld.mean() < 0.05, f"KLD max {kld.max():.3f}, mean {kld.mean():.4f}"
                assert (got.argmax(1) == want.argmax(1)).mean() >= 0.9
    if rows_move and not f16:
        kld, same = np.concatenate(rows).T
        ok = kld < 0.25
        assert ok.mean() >= 0.9 and kld[ok].mean() < 0.05, f"KLD per row {kld.round(3).tolist()}"
        assert same.mean() >= 0.9


@pytest.mark.parametrize("f16", [True, False], ids=["F16", "Q4_K_M"])
@pytest.mark.parametrize("name", NAMES)
def test_cpu_matches_reference(tmp_path, synthetic, backends, name, f16):
    path = write_family(tmp_path / f"{name}.gguf", name, f16=True) if f16 else synthetic[name]
    assert_follows_reference(backends[0], backends[1], path, f16, rows_move=FAMILIES[name].n_expert > 0)


def test_unsupported_architecture_lists_the_families(tmp_path, backends):
    import gguf

    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "nonesuch")
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    with GGUFFile(path) as f, pytest.raises(ModelError) as e:
        load_model(f, backends[0])
    message = str(e.value)
    assert "nonesuch" in message and "\n" not in message
    for name in NAMES + ["llama", "gemma3"]:
        assert name in message


@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss", "phi3"])
def test_a_streamed_file_is_the_file_written_at_once(tmp_path, synthetic, name):
    """Big benchmark files are written a tensor at a time (each made as it is written): the same bytes,
    router, biases and rope factors included."""
    path = write_family(tmp_path / f"{name}.gguf", name, stream=True)
    assert path.read_bytes() == synthetic[name].read_bytes()
    with pytest.raises(ValueError, match="streamed"):
        write_family(tmp_path / "x.gguf", name, stream=True, drop="blk.0.attn_q.weight")


@pytest.mark.parametrize("name,drop,expected", [
    ("granite", "granite.attention.layer_norm_rms_epsilon", "metadata 'granite.attention.layer_norm_rms_epsilon' is missing"),
    ("phi3", "blk.1.attn_qkv.weight", "tensor 'blk.1.attn_q.weight' is missing"),
    ("olmo2", "blk.2.attn_k_norm.weight", "tensor 'blk.2.attn_k_norm.weight' is missing"),
    ("qwen3", "blk.0.attn_q_norm.weight", "tensor 'blk.0.attn_q_norm.weight' is missing"),
    ("qwen3moe", "qwen3moe.expert_used_count", "metadata 'qwen3moe.expert_used_count' is missing"),
    ("qwen3moe", "blk.1.ffn_down_exps.weight", "tensor 'blk.1.ffn_down_exps.weight' is missing"),
])
def test_a_missing_key_or_tensor_is_named(tmp_path, backends, name, drop, expected):
    path = tmp_path / f"{name}.gguf"
    write_family(path, name, drop=drop)
    with GGUFFile(path) as f, pytest.raises(ModelError, match=expected.replace(".", r"\.")):
        load_model(f, backends[0])


def test_logits_file_round_trip_and_truncation(tmp_path):
    from ember.engine.kld import LogitsFileError, open_base, write_base

    rng = np.random.default_rng(0)
    logits = [rng.normal(0, 5, (3, 1001)).astype(np.float32) for _ in range(2)]  # odd vocabulary: padded
    path = tmp_path / "base.kld"
    write_base(path, 8, 1001, list(range(16)), iter(logits))
    base = open_base(path)
    assert (base.n_ctx, base.n_vocab, base.n_chunk, base.tokens.tolist()) == (8, 1001, 2, list(range(16)))
    for c in range(2):
        z = logits[c] - logits[c].max(axis=1, keepdims=True)
        want = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        got = base.log_probs(c)
        kept = want > want.max(axis=1, keepdims=True) - 16
        assert np.abs(got - want)[kept].max() < 16 / 65535 + 1e-5  # one step of the 16-bit code
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(LogitsFileError, match="truncated: .* \\(10 bytes missing\\)"):
        open_base(path)


def test_a_cut_file_names_the_missing_bytes(synthetic, tmp_path):
    from ember.gguf_loader import GGUFError

    data = synthetic["qwen3"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) // 2])
    with pytest.raises(GGUFError, match=r"runs past end of file .* cut short, \d+ bytes missing \(\d+ of \d+ tensors"):
        GGUFFile(cut)


def test_info_on_a_cut_file_shows_what_is_there_and_the_missing_bytes(synthetic, tmp_path, capsys):
    from ember.cli import main

    data = synthetic["qwen2"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) // 2])
    assert main(["info", str(cut)]) == 1
    out, err = capsys.readouterr()
    assert "qwen2.block_count [u32] = 4" in out and "tokenizer.ggml.tokens" in out
    assert "(missing)" in out and "blk.3.ffn_down.weight" in out
    assert err.count("\n") == 1 and "cut short" in err and "bytes missing" in err
    assert main(["tokenize", str(cut), "Hello world", "--json"]) == 0  # the vocabulary is all there
    assert capsys.readouterr().out.strip() == "[19556, 905]"


def test_phi3_takes_the_long_rotary_factors_beyond_the_original_context(synthetic, backends):
    with GGUFFile(synthetic["phi3"]) as f:
        model = load_model(f, backends[1])
        short = np.asarray(f.tensors["rope_factors_short.weight"].array())
        long = np.asarray(f.tensors["rope_factors_long.weight"].array())
        assert model.args.rope.n_rot == 32 and model.args.head_dim == 64  # partial rotary
        assert np.array_equal(model.args.rope.freq_factors, short)
        model.set_context(4096)
        assert np.array_equal(model.args.rope.freq_factors, short)
        model.set_context(4097)
        assert np.array_equal(model.args.rope.freq_factors, long)
        assert model.args.rope.attn_factor == pytest.approx(1.19)
