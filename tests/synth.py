"""Tiny synthetic GGUF models, written with the `gguf` package's writer, for every
architecture and weight type ember supports (test data, not a model of anything)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ember.quant import GGMLType, dequantize, layout, quantize

# Offsets of the float16 scale fields in one block of each type built from random bytes:
# random bits there could be inf/NaN or huge, so they are set to small finite scales.
F16_FIELDS = {
    GGMLType.Q2_K: (80, 82), GGMLType.Q3_K: (108,), GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,), GGMLType.IQ4_NL: (0,), GGMLType.IQ4_XS: (0,),
    GGMLType.IQ2_XXS: (0,), GGMLType.IQ2_XS: (0,), GGMLType.IQ2_S: (0,), GGMLType.IQ3_XXS: (0,),
    GGMLType.IQ3_S: (0,), GGMLType.IQ1_S: (0,), GGMLType.TQ1_0: (52,), GGMLType.TQ2_0: (64,),
    GGMLType.IQ1_M: (48,),  # the f16 scale spread over the top nibbles of the four words at 48
}
QUANTIZABLE = {GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0,
               GGMLType.Q5_1, GGMLType.Q8_0}
ALL_TYPES = sorted(QUANTIZABLE | set(F16_FIELDS), key=int)


def random_blocks(rng: np.random.Generator, qtype: GGMLType, rows: int, cols: int, std: float) -> np.ndarray:
    """(rows, row_bytes) of random blocks, their f16 scale fields set so the values have about `std`."""
    lay = layout(qtype)
    n_blocks = rows * cols // lay.block_size
    blocks = rng.integers(0, 256, size=(n_blocks, lay.type_size), dtype=np.uint8)
    scales = rng.uniform(0.5, 1.0, (n_blocks, len(F16_FIELDS[qtype])))
    set_scales(blocks, qtype, scales)
    # values are linear in the scale fields: measure once, then rescale to the target spread
    spread = float(dequantize(blocks.reshape(-1), qtype).std())
    set_scales(blocks, qtype, scales * (std / spread))
    return blocks.reshape(rows, -1)


def set_scales(blocks: np.ndarray, qtype: GGMLType, scales: np.ndarray) -> None:
    if qtype == GGMLType.IQ1_M:
        bits = scales[:, 0].astype(np.float16).view(np.uint16)[:, None] >> np.array([0, 4, 8, 12], np.uint16)
        words = blocks[:, 48:56].copy().view("<u2") & np.uint16(0x0FFF)
        blocks[:, 48:56] = (words | ((bits & np.uint16(15)) << np.uint16(12))).view(np.uint8)
        return
    for j, off in enumerate(F16_FIELDS[qtype]):
        blocks[:, off:off + 2] = scales[:, j].astype(np.float16).view(np.uint8).reshape(-1, 2)


def weight(rng: np.random.Generator, qtype: GGMLType, rows: int, cols: int, std: float) -> np.ndarray:
    if qtype in QUANTIZABLE:
        return quantize(rng.normal(0.0, std, (rows, cols)).astype(np.float32), qtype)
    return random_blocks(rng, qtype, rows, cols, std)


@dataclass(frozen=True)
class Shape:
    n_layer: int = 2
    d_model: int = 256
    d_ff: int = 512
    n_head: int = 4
    n_kv_head: int = 2
    head_dim: int = 64
    n_vocab: int = 320


def add_vocab(w: gguf.GGUFWriter, n_vocab: int) -> None:
    """A small SentencePiece-style vocabulary: unk/bos/eos, 256 byte tokens, then letter pieces."""
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += ["\u2581" + a for a in "abcdefghijklmnopqrstuvwxyz"] + [a + b for a in "etaoin" for b in "etaoinshrd"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    tokens = tokens[:n_vocab] + [f"<extra{i}>" for i in range(n_vocab - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (n_vocab - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(n_vocab - 259)])
    w.add_token_types(types[:n_vocab])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)


def write_model(path: Path, arch: str, qtype: GGMLType, shape: Shape = Shape(), seed: int = 0,
                tied: bool = True, window: int = 8, vocab: bool = False) -> Path:
    """A random `arch` ("llama" or "gemma3") model whose matrices are all `qtype`."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    s = shape
    w.add_block_count(s.n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(s.d_model)
    w.add_feed_forward_length(s.d_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_kv_head)
    w.add_layer_norm_rms_eps(1e-6 if arch == "gemma3" else 1e-5)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(10000.0 if arch == "llama" else 1e6)
    if arch == "gemma3":
        w.add_sliding_window(window)
    if vocab:
        add_vocab(w, s.n_vocab)

    def matrix(name: str, rows: int, cols: int, std: float = 0.05) -> None:
        data = weight(rng, qtype, rows, cols, std)
        if qtype in (GGMLType.F32,):
            w.add_tensor(name, data.view(np.float32).reshape(rows, cols))
        elif qtype == GGMLType.F16:
            w.add_tensor(name, data.view(np.float16).reshape(rows, cols))
        else:
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(int(qtype)))

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, rng.uniform(0.8, 1.2, n).astype(np.float32))

    q_dim, kv_dim = s.n_head * s.head_dim, s.n_kv_head * s.head_dim
    matrix("token_embd.weight", s.n_vocab, s.d_model, std=1.0)
    for i in range(s.n_layer):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", s.d_model)
        matrix(p + "attn_q.weight", q_dim, s.d_model)
        matrix(p + "attn_k.weight", kv_dim, s.d_model)
        matrix(p + "attn_v.weight", kv_dim, s.d_model)
        matrix(p + "attn_output.weight", s.d_model, q_dim)
        norm(p + "ffn_norm.weight", s.d_model)
        matrix(p + "ffn_gate.weight", s.d_ff, s.d_model)
        matrix(p + "ffn_up.weight", s.d_ff, s.d_model)
        matrix(p + "ffn_down.weight", s.d_model, s.d_ff)
        if arch == "gemma3":
            norm(p + "attn_q_norm.weight", s.head_dim)
            norm(p + "attn_k_norm.weight", s.head_dim)
            norm(p + "post_attention_norm.weight", s.d_model)
            norm(p + "post_ffw_norm.weight", s.d_model)
    norm("output_norm.weight", s.d_model)
    if not tied:
        matrix("output.weight", s.n_vocab, s.d_model)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
