"""The size ladder of the CPU benchmarks: the two real models, then llama-shaped files at the sizes
people run, in the type mix llama.cpp's quantizer writes for Q4_K_M.

The synthetic files hold random blocks (small valid scales), so their tokens mean nothing, but every
byte a decode step reads is where a real file of that shape has it: Q4_K matrices, Q6_K for attn_v
and ffn_down in the layers llama.cpp gives more bits to, and a Q6_K output head (the tied embedding
when the model ties them). A SentencePiece vocabulary of the real size lets llama.cpp load the same
file. Files are written once into ~/.cache/ember/bench (EMBER_BENCH_MODELS overrides), outside the
repository.

The decoder families (`--models qwen3-0.6b ...`) are written by tests/families.py at the shape of
each family's smallest released model, with every structural feature of the family (biases, QK-norms,
soft-caps, fused tensors, partial rotary, experts) and SmolLM2's 49152-token vocabulary in place of
the family's own (so their output heads are smaller than the real ones).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ember.quant import GGMLType, layout

T = GGMLType


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    n_layer: int
    d_model: int
    d_ff: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_vocab: int
    tied: bool  # the output head is the token embedding


SHAPES = {s.name: s for s in (
    Shape("llama-1b", 16, 2048, 8192, 32, 8, 64, 128256, True),      # Llama-3.2-1B
    Shape("qwen3-4b", 36, 2560, 9728, 32, 8, 128, 151936, True),     # Qwen3-4B's sizes, llama architecture
    Shape("llama-8b", 32, 4096, 14336, 32, 8, 128, 128256, False),   # Llama-3.1-8B
)}

# The real models: (name for ember.hub, llama.cpp's file name).
REAL = ("smollm2", "gemma3-270m")
LADDER = (*REAL, *SHAPES)
# Rung name -> decoder family of tests/families.py, at its REAL_SHAPES size.
FAMILIES = {"qwen2-0.5b": "qwen2", "qwen3-0.6b": "qwen3", "olmo2-1b": "olmo2", "granite-2b": "granite",
            "gemma2-2b": "gemma2", "ministral3-3b": "mistral3", "smollm3-3b": "smollm3", "phi4-mini": "phi3",
            "qwen3-30b-a3b-8l": "qwen3moe", "gpt-oss-20b-6l": "gpt-oss", "olmoe-1b-7b": "qwen3moe",
            "qwen3-30b-a3b": "qwen3moe"}
# Rungs with fewer layers than their family's model (the layers at its shape, so that the file fits
# a small machine): Qwen3-30B-A3B's 48 layers of 128 experts are 17.8 GB in Q4_K_M (`qwen3-30b-a3b`,
# the whole model: for machines of 24 GB or more), 8 of them 2.9 GB; gpt-oss-20b's 24 layers of 32
# MXFP4 experts 10 GB, 6 of them 2.6 GB.
FAMILY_LAYERS = {"qwen3-30b-a3b-8l": 8, "gpt-oss-20b-6l": 6}
# Rungs at another model's sizes in a family's structure: OLMoE-1B-7B (16 layers of 64 experts,
# 8 active, 1024 wide; 6.9 B parameters, 1.3 B active) as a qwen3moe file (softmax top-k routing
# over stacked Q4_K_M experts, per-head QK norms), the whole model.
FAMILY_SIZES = {"olmoe-1b-7b": dict(n_layer=16, d_model=2048, d_ff=1024, n_head=16, n_kv_head=16, head_dim=128,
                                    n_expert=64, n_used=8, d_ff_exp=1024)}

# f16 fields of the random blocks (everything else may be any byte) and the scale written there: the
# values then spread about as a trained layer's do (|w| mostly below 0.1)
SCALES = {T.Q4_K: ((0, 0.0005), (2, 0.0005)), T.Q6_K: ((208, 0.0001),)}


def cache_dir() -> Path:
    return Path(os.environ.get("EMBER_BENCH_MODELS", Path.home() / ".cache" / "ember" / "bench"))


def more_bits(i: int, n: int) -> bool:
    """The layers llama.cpp's Q4_K_M gives Q6_K for attn_v and ffn_down: the first and last eighth,
    and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def matrices(s: Shape) -> list[tuple[str, GGMLType, int, int]]:
    """(name, type, rows, cols) of every matrix of the file, in file order."""
    q_dim, kv_dim = s.n_head * s.head_dim, s.n_kv_head * s.head_dim
    out = [("token_embd.weight", T.Q6_K if s.tied else T.Q4_K, s.n_vocab, s.d_model)]
    for i in range(s.n_layer):
        p, hi = f"blk.{i}.", T.Q6_K if more_bits(i, s.n_layer) else T.Q4_K
        out += [(p + "attn_q.weight", T.Q4_K, q_dim, s.d_model), (p + "attn_k.weight", T.Q4_K, kv_dim, s.d_model),
                (p + "attn_v.weight", hi, kv_dim, s.d_model), (p + "attn_output.weight", T.Q4_K, s.d_model, q_dim),
                (p + "ffn_gate.weight", T.Q4_K, s.d_ff, s.d_model), (p + "ffn_up.weight", T.Q4_K, s.d_ff, s.d_model),
                (p + "ffn_down.weight", hi, s.d_model, s.d_ff)]
    if not s.tied:
        out.append(("output.weight", T.Q6_K, s.n_vocab, s.d_model))
    return out


def step_bytes(s: Shape) -> int:
    """Bytes of weights one decode step reads: every layer matrix and the output head (the embedding
    lookup reads one row)."""
    head = "token_embd.weight" if s.tied else "output.weight"
    return sum(rows * layout(t).row_bytes(cols) for name, t, rows, cols in matrices(s)
               if name == head or name.startswith("blk."))


def path_for(name: str) -> Path:
    return cache_dir() / f"{name}-q4_k_m-synthetic.gguf"


def ensure(name: str) -> Path:
    """The file of ladder rung `name`: a real model's path, or the synthetic file (written on first use)."""
    if name in REAL:
        from ember import hub
        return hub.resolve(name)
    path = path_for(name)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        if name in FAMILIES:
            import sys
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from families import write_family
            write_family(tmp, FAMILIES[name], real_shape=True, n_layer=FAMILY_LAYERS.get(name, 0),
                         sizes=FAMILY_SIZES.get(name), stream=True)
        else:
            write(tmp, SHAPES[name])
        tmp.rename(path)
    return path


def write(path: Path, s: Shape) -> None:
    """A llama-architecture GGUF of shape s in the Q4_K_M mix, tensors streamed to disk one at a time."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"synthetic {s.name} Q4_K_M")
    w.add_file_type(15)  # MOSTLY_Q4_K_M
    w.add_block_count(s.n_layer)
    w.add_context_length(8192)
    w.add_embedding_length(s.d_model)
    w.add_feed_forward_length(s.d_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_kv_head)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s.n_vocab)
    add_vocab(w, s.n_vocab)
    tensors = [(name, None, (d,)) for name, d in norms(s)]
    tensors += [(name, t, (rows, cols)) for name, t, rows, cols in matrices(s)]
    for name, t, shape in tensors:
        if t is None:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            nbytes = shape[0] * layout(t).row_bytes(shape[1])
            w.add_tensor_info(name, (shape[0], layout(t).row_bytes(shape[1])), np.dtype(np.uint8), nbytes,
                              raw_dtype=gguf.GGMLQuantizationType(int(t)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, t, shape in tensors:
        w.write_tensor_data(np.ones(shape, np.float32) if t is None else random_blocks(rng, t, *shape))
    w.close()


def norms(s: Shape) -> list[tuple[str, int]]:
    out = [("output_norm.weight", s.d_model)]
    for i in range(s.n_layer):
        out += [(f"blk.{i}.attn_norm.weight", s.d_model), (f"blk.{i}.ffn_norm.weight", s.d_model)]
    return out


def random_blocks(rng: np.random.Generator, t: GGMLType, rows: int, cols: int) -> np.ndarray:
    lay = layout(t)
    blocks = rng.integers(0, 256, size=(rows * cols // lay.block_size, lay.type_size), dtype=np.uint8)
    for off, value in SCALES[t]:
        blocks[:, off:off + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def add_vocab(w, n_vocab: int) -> None:
    """SentencePiece tokens that both tokenizers accept: unk, bos, eos, the 256 byte tokens, then
    distinct word pieces up to the real vocabulary size."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581w{i}" for i in range(n_vocab - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(n_vocab - 259)])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (n_vocab - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
