"""Synthetic GGUF files of every decoder family, written with the `gguf` package: small widths (or
the shape of the family's smallest released model, for benchmarks), every structural feature of
the family, SmolLM2's real vocabulary, a Q4_K_M-style mix of weight types, and weights scaled so
that next-token distributions are peaked. Deterministic: the same arguments write the same bytes.

    python tests/families.py OUT_DIR [--real-shape] [FAMILY ...]
"""
from __future__ import annotations

import argparse
import functools
import lzma
import math
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synth import random_blocks  # noqa: E402

from ember.gguf_loader import GGUFFile  # noqa: E402
from ember.quant import GGMLType, layout, quantize  # noqa: E402

Q4_K, Q6_K, Q8_0 = GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0
FALLBACK = {Q4_K: GGMLType.Q5_0, Q6_K: GGMLType.Q8_0}
LOGIT_STD = 6.0  # spread of the logits: the best token usually stands well clear of the next


@dataclass(frozen=True)
class Family:
    arch: str
    n_layer: int = 4
    d_model: int = 256
    d_ff: int = 512
    n_head: int = 4
    n_kv_head: int = 2
    head_dim: int = 64
    n_rot: int = 0  # 0: the whole head
    tied: bool = False
    neox: bool = True
    meta: dict = field(default_factory=dict)  # "<arch>.KEY": value, beyond the common keys
    n_expert: int = 0  # > 0: a mixture of experts in place of the gated MLP
    n_used: int = 0
    d_ff_exp: int = 0

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim


FAMILIES = {
    "qwen2": Family("qwen2", meta={"rope.freq_base": 1e6}),
    "qwen3": Family("qwen3", head_dim=128, tied=True, meta={"rope.freq_base": 1e6}),  # q_dim 512 != d_model
    "gemma2": Family("gemma2", tied=True, meta={"attention.sliding_window": 16, "attn_logit_softcapping": 50.0,
                                                 "final_logit_softcapping": 30.0}),
    "phi3": Family("phi3", n_kv_head=4, n_rot=32, meta={"context_length": 131072,
                                                        "rope.scaling.original_context_length": 4096,
                                                        "rope.scaling.attn_factor": 1.19}),
    "mistral3": Family("mistral3", meta={"rope.freq_base": 1e6, "rope.scaling.type": "yarn",
                                         "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 32,
                                         "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0,
                                         "attention.temperature_scale": 0.1}),
    "smollm3": Family("smollm3", tied=True, meta={"rope.freq_base": 5e6}),
    "granite": Family("granite", tied=True, meta={"embedding_scale": 12.0, "residual_scale": 0.22,
                                                  "attention.scale": 0.015625, "logit_scale": 8.0}),
    "olmo2": Family("olmo2", n_kv_head=4, meta={"rope.freq_base": 5e5, "attention.sliding_window": 16}),
    "qwen3moe": Family("qwen3moe", head_dim=128, meta={"rope.freq_base": 1e6}, n_expert=16, n_used=4, d_ff_exp=256),
    "gpt-oss": Family("gpt-oss", meta={"rope.freq_base": 150000.0, "attention.sliding_window": 16,
                                       "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                       "rope.scaling.original_context_length": 32},
                      n_expert=16, n_used=4, d_ff_exp=256),
}
NEOX = {"qwen2", "qwen3", "gemma2", "phi3", "olmo2", "qwen3moe", "gpt-oss"}
MXFP4 = GGMLType.MXFP4

# The smallest released member of each family (for speed: the widths matter, not the values).
REAL_SHAPES = {
    "qwen2": dict(n_layer=24, d_model=896, d_ff=4864, n_head=14, n_kv_head=2, head_dim=64),  # Qwen2.5-0.5B
    "qwen3": dict(n_layer=28, d_model=1024, d_ff=3072, n_head=16, n_kv_head=8, head_dim=128),  # Qwen3-0.6B
    "gemma2": dict(n_layer=26, d_model=2304, d_ff=9216, n_head=8, n_kv_head=4, head_dim=256),  # Gemma-2-2B
    "phi3": dict(n_layer=32, d_model=3072, d_ff=8192, n_head=24, n_kv_head=8, head_dim=128, n_rot=96),  # Phi-4-mini
    "mistral3": dict(n_layer=26, d_model=3072, d_ff=9216, n_head=32, n_kv_head=8, head_dim=128),  # Ministral-3-3B
    "smollm3": dict(n_layer=36, d_model=2048, d_ff=11008, n_head=16, n_kv_head=4, head_dim=128),  # SmolLM3-3B
    "granite": dict(n_layer=40, d_model=2048, d_ff=8192, n_head=32, n_kv_head=8, head_dim=64),  # Granite-3.x-2B
    "olmo2": dict(n_layer=16, d_model=2048, d_ff=8192, n_head=16, n_kv_head=16, head_dim=128),  # OLMo-2-1B
    "qwen3moe": dict(n_layer=48, d_model=2048, d_ff=6144, n_head=32, n_kv_head=4, head_dim=128, n_expert=128,
                     n_used=8, d_ff_exp=768),  # Qwen3-30B-A3B
    "gpt-oss": dict(n_layer=24, d_model=2880, d_ff=2880, n_head=64, n_kv_head=8, head_dim=64, n_expert=32,
                    n_used=4, d_ff_exp=2880),  # gpt-oss-20b
}


VOCAB = Path(__file__).resolve().parent / "data" / "smollm2-vocab.gguf.xz"  # SmolLM2-135M's metadata, no tensors


@functools.lru_cache(maxsize=1)
def vocabulary_source() -> Path:
    """SmolLM2's vocabulary as a tensor-less GGUF file (unpacked once per process)."""
    path = Path(tempfile.mkdtemp(prefix="ember-vocab-")) / "smollm2-vocab.gguf"
    path.write_bytes(lzma.decompress(VOCAB.read_bytes()))
    return path


def tokenizer_metadata(path: Path) -> dict:
    with GGUFFile(path) as f:
        return {k: v for k, v in f.metadata.items() if k.startswith("tokenizer.")}


def add_metadata(w: gguf.GGUFWriter, key: str, value) -> None:
    value = [v.item() if isinstance(v, np.generic) else v for v in value] if isinstance(value, list) else value
    value = value.tolist() if isinstance(value, (np.ndarray, np.generic)) else value
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    else:
        values = list(value)
        if values and isinstance(values[0], float):
            w.add_key_value(key, values, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
        elif values and isinstance(values[0], int):
            w.add_key_value(key, values, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        else:
            w.add_array(key, values)


# MXFP4 stacks of more values than this (the benchmark shapes: billions, an hour of numpy quantizing)
# take random codes; the test files' are quantized normal values (better conditioned: random codes
# put an eighth of the weights at +-12 scale units, and such a small model's greedy path turns on
# margins finer than the float64 reference and llama.cpp agree on).
FAST_MXFP4_VALUES = 1 << 26


def mxfp4_blocks(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """(rows, row bytes) of MXFP4 blocks of random codes (the levels' RMS is 5.85 scale units) under the
    power-of-two scale nearest `std`, a step up or down at random (written fast at any size)."""
    blocks = rng.integers(0, 256, (rows * cols // 32, 17), dtype=np.uint8)
    e = round(math.log2(std / 5.85)) + 128 + rng.integers(-1, 2, len(blocks))
    blocks[:, 0] = np.clip(e, 0, 254)
    return blocks.reshape(rows, -1)


class Writer:
    """Tensors of one file: matrices as random blocks of their type at a chosen spread."""

    def __init__(self, w: gguf.GGUFWriter, seed: int, f16: bool = False, stream: bool = False):
        self.w, self.rng, self.f16 = w, np.random.default_rng(seed), f16
        # stream: each tensor's info now, its data made (in the same order, so from the same values of
        # the generator) only when write_pending writes it: a file larger than the memory can be written
        self.pending = [] if stream else None

    def _add(self, name: str, make, shape: tuple, dtype, qtype: GGMLType | None = None) -> None:
        raw = gguf.GGMLQuantizationType(int(qtype)) if qtype is not None else None
        if self.pending is None:
            self.w.add_tensor(name, make(), raw_dtype=raw)
            return
        self.w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize,
                               raw_dtype=raw)
        self.pending.append(make)

    def array(self, name: str, make, shape: tuple) -> None:
        """An f32 tensor of `shape` that make() returns."""
        self._add(name, make, shape, np.float32)

    def write_pending(self) -> None:
        for make in self.pending:
            self.w.write_tensor_data(make())

    def matrix(self, name: str, rows: int, cols: int, std: float, qtype: GGMLType = Q4_K, experts: int = 0) -> None:
        """A (rows, cols) matrix, or `experts` of them stacked (experts, rows, cols)."""
        if self.f16:  # every matrix in F16: the family's structure without activation rounding
            qtype = GGMLType.F16
        if cols % 256 and qtype in FALLBACK:  # rows that are not whole super-blocks, as llama-quantize does
            qtype = FALLBACK[qtype]
        n = rows * max(experts, 1)

        def make():
            if qtype in (Q4_K, Q6_K):
                data = random_blocks(self.rng, qtype, n, cols, std)
            elif qtype == MXFP4 and n * cols > FAST_MXFP4_VALUES:
                data = mxfp4_blocks(self.rng, n, cols, std)
            else:  # a matrix at a time: the same stream of values, a fraction of the memory
                data = np.concatenate([quantize(self.rng.normal(0.0, std, (rows, cols)).astype(np.float32), qtype)
                                       for _ in range(max(experts, 1))])
            return data.reshape(experts, rows, -1) if experts else data

        row_bytes = layout(qtype).row_bytes(cols)
        self._add(name, make, (experts, rows, row_bytes) if experts else (n, row_bytes), np.uint8, qtype)

    def vector(self, name: str, n: int, mean: float = 1.0, spread: float = 0.1) -> None:
        self.array(name, lambda: (mean + self.rng.uniform(-spread, spread, n)).astype(np.float32), (n,))


def write_family(path: Path, name: str, real_shape: bool = False, seed: int = 0,
                 vocab_from: Path | None = None, drop: str = "", f16: bool = False,
                 extra_metadata: dict | None = None, extra_tensors=None, n_layer: int = 0,
                 sizes: dict | None = None, stream: bool = False) -> Path:
    """The synthetic `name` model at `path` (see the module doc); `drop`: a metadata key or tensor
    left out (to test the error naming it); `f16`: every matrix in F16 instead of the K-quant mix;
    extra_metadata: keys added; extra_tensors(writer, Writer, d_model): adds keys and tensors;
    `n_layer`: that many layers instead of the shape's (a big shape's layers, fewer of them); `sizes`:
    other Family fields replaced (e.g. wider experts); `stream`: each tensor made as it is written (a
    file larger than the memory; not with `drop` or extra_tensors)."""
    if stream and (drop or extra_tensors is not None):
        raise ValueError("a streamed file takes no dropped key and no extra tensors")
    f = FAMILIES[name]
    if real_shape:
        f = replace(f, **REAL_SHAPES[name])
    if n_layer:
        f = replace(f, n_layer=n_layer)
    if sizes:
        f = replace(f, **sizes)
    tok = tokenizer_metadata(vocab_from or vocabulary_source())
    n_vocab = len(tok["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(path), f.arch)
    if drop:
        add_kv, add_tensor = w.add_key_value, w.add_tensor
        w.add_key_value = lambda key, *a, **k: None if key == drop else add_kv(key, *a, **k)
        w.add_tensor = lambda key, *a, **k: None if key == drop else add_tensor(key, *a, **k)
    header(w, f)
    for key, value in tok.items():
        if key != "tokenizer.chat_template":
            add_metadata(w, key, value)
    for key, value in (extra_metadata or {}).items():
        add_metadata(w, key, value)
    t = Writer(w, seed, f16, stream)
    tensors(t, f, n_vocab)
    if extra_tensors is not None:
        extra_tensors(w, t, f.d_model)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    if stream:
        w.write_ti_data_to_file()
        t.write_pending()
    else:
        w.write_tensors_to_file()
    w.close()
    return path


def header(w: gguf.GGUFWriter, f: Family) -> None:
    a = f.arch
    w.add_name("synthetic")  # llama.cpp gives Phi-3 names' special tokens attributes looked up by text
    w.add_block_count(f.n_layer)
    w.add_context_length(int(f.meta.get("context_length", 4096)))
    w.add_embedding_length(f.d_model)
    w.add_feed_forward_length(f.d_ff)
    w.add_head_count(f.n_head)
    w.add_head_count_kv(f.n_kv_head)
    w.add_key_length(f.head_dim)
    w.add_value_length(f.head_dim)
    w.add_rope_dimension_count(f.n_rot or f.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(15)  # MOSTLY_Q4_K_M
    if f.n_expert:
        w.add_expert_count(f.n_expert)
        w.add_expert_used_count(f.n_used)
        w.add_expert_feed_forward_length(f.d_ff_exp)
    for key, value in f.meta.items():
        if key != "context_length":
            add_metadata(w, f"{a}.{key}", value)


def tensors(t: Writer, f: Family, n_vocab: int) -> None:
    d, a = f.d_model, f.arch
    gemma = a == "gemma2"
    embd_std = 1.0 / math.sqrt(d) if gemma else 1.0  # gemma scales embeddings by sqrt(d)
    if a == "granite":
        embd_std /= f.meta["embedding_scale"]
    t.matrix("token_embd.weight", n_vocab, d, embd_std, Q6_K if f.tied else Q4_K)
    for i in range(f.n_layer):
        layer(t, f, i)
    # the output norm sets the logits' spread: LOGIT_STD for rows of unit RMS
    out_std = embd_std if f.tied else 1.0 / math.sqrt(d)
    gain = LOGIT_STD / (out_std * math.sqrt(d)) * f.meta.get("logit_scale", 1.0)
    if gemma:
        gain = 1.0 / (out_std * math.sqrt(d)) * 20.0  # soft-capped at 30: spread 20 before the cap
    t.vector("output_norm.weight", d, mean=gain, spread=0.1 * gain)
    if not f.tied:
        t.matrix("output.weight", n_vocab, d, out_std, Q6_K)
    if a == "phi3":
        n = (f.n_rot or f.head_dim) // 2
        t.array("rope_factors_short.weight", lambda: np.linspace(1.0, 1.6, n, dtype=np.float32), (n,))
        t.array("rope_factors_long.weight", lambda: np.linspace(1.0, 12.0, n, dtype=np.float32), (n,))


def layer(t: Writer, f: Family, i: int) -> None:
    p, d, a = f"blk.{i}.", f.d_model, f.arch
    more_bits = i % 3 == 0  # as Q4_K_M gives some layers' attn_v and ffn_down 6 bits
    std_in = 1.0 / math.sqrt(d)
    oss = a == "gpt-oss"
    if a != "olmo2":
        t.vector(p + "attn_norm.weight", d)
        t.vector(p + ("post_attention_norm.weight" if oss else "ffn_norm.weight"), d)
    if a == "phi3":
        t.matrix(p + "attn_qkv.weight", f.q_dim + 2 * f.kv_dim, d, std_in)
    else:
        attn_type = Q8_0 if oss else Q4_K  # gpt-oss's attention is not MXFP4
        t.matrix(p + "attn_q.weight", f.q_dim, d, std_in, attn_type)
        t.matrix(p + "attn_k.weight", f.kv_dim, d, std_in, attn_type)
        t.matrix(p + "attn_v.weight", f.kv_dim, d, std_in, Q8_0 if oss else Q6_K if more_bits else Q4_K)
    if a in ("qwen2", "gpt-oss"):
        for n, size in (("q", f.q_dim), ("k", f.kv_dim), ("v", f.kv_dim)):
            t.vector(p + f"attn_{n}.bias", size, mean=0.0, spread=0.5)
    if a in ("qwen3", "qwen3moe"):
        t.vector(p + "attn_q_norm.weight", f.head_dim)
        t.vector(p + "attn_k_norm.weight", f.head_dim)
    if a == "olmo2":
        t.vector(p + "attn_q_norm.weight", f.q_dim)
        t.vector(p + "attn_k_norm.weight", f.kv_dim)
    block_std = 0.5 if a != "granite" else 0.5 / f.meta["residual_scale"]
    if a in ("gemma2", "olmo2"):  # normed after: the norm sets the size
        t.vector(p + "post_attention_norm.weight", d, mean=block_std)
        t.vector(p + "post_ffw_norm.weight", d, mean=block_std)
        block_std = 1.0
    t.matrix(p + "attn_output.weight", d, f.q_dim, block_std / math.sqrt(f.q_dim), Q8_0 if oss else Q4_K)
    if oss:
        t.vector(p + "attn_output.bias", d, mean=0.0, spread=0.1)
        t.vector(p + "attn_sinks.weight", f.n_head, mean=0.0, spread=2.0)
    if f.n_expert:
        experts(t, f, p, block_std, more_bits)
    elif a == "phi3":
        t.matrix(p + "ffn_up.weight", 2 * f.d_ff, d, std_in)
    else:
        t.matrix(p + "ffn_gate.weight", f.d_ff, d, std_in)
        t.matrix(p + "ffn_up.weight", f.d_ff, d, std_in)
    if not f.n_expert:
        t.matrix(p + "ffn_down.weight", d, f.d_ff, 2 * block_std / math.sqrt(f.d_ff), Q6_K if more_bits else Q4_K)


ROUTER_SPREAD = 2.5  # of the router's logits: the chosen experts usually stand clear of the others


def experts(t: Writer, f: Family, p: str, block_std: float, more_bits: bool) -> None:
    """The router (F32, as llama-quantize leaves it) and the stacked experts (gpt-oss: MXFP4, with
    biases on the router and every expert)."""
    d, n, e = f.d_model, f.d_ff_exp, f.n_expert
    oss = f.arch == "gpt-oss"
    t.array(p + "ffn_gate_inp.weight", lambda: t.rng.normal(0.0, ROUTER_SPREAD / math.sqrt(d), (e, d)).astype(np.float32),
            (e, d))
    t.matrix(p + "ffn_gate_exps.weight", n, d, 1.0 / math.sqrt(d), MXFP4 if oss else Q4_K, experts=e)
    t.matrix(p + "ffn_up_exps.weight", n, d, 1.0 / math.sqrt(d), MXFP4 if oss else Q4_K, experts=e)
    down = MXFP4 if oss else Q6_K if more_bits else Q4_K
    t.matrix(p + "ffn_down_exps.weight", d, n, 2 * block_std / math.sqrt(n), down, experts=e)
    if oss:
        t.vector(p + "ffn_gate_inp.bias", e, mean=0.0, spread=0.5)
        for name, size in (("gate", n), ("up", n), ("down", d)):
            t.array(p + f"ffn_{name}_exps.bias", lambda size=size: t.rng.uniform(-0.1, 0.1, (e, size)).astype(np.float32),
                    (e, size))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("families", nargs="*", default=sorted(FAMILIES))
    ap.add_argument("--real-shape", action="store_true", help="the smallest released member's widths")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.families:
        suffix = "-real" if args.real_shape else ""
        print(write_family(args.out / f"{name}{suffix}.gguf", name, args.real_shape))


if __name__ == "__main__":
    main()
