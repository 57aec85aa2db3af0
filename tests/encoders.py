"""Synthetic GGUF files for embeddings and reranking, written with the `gguf` package: a BERT
encoder with a WordPiece vocabulary (optionally a classification head: a bert reranker), and a
Qwen3-style decoder reranker (tests/families.py's qwen3 with a two-label `cls.output` head and
a rerank template), and a decoder whose vocabulary has FIM tokens (for /infill). Deterministic: the same arguments write the same bytes.

    python tests/encoders.py OUT_DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from families import Writer, write_family  # noqa: E402

from ember.quant import GGMLType  # noqa: E402

WORDS = ("the a an of to in on is was and for with that it as at by from this be are or not cat dog sat "
         "mat fish swim sea blue sky cloud rain sun day night city river tree bird song book read write "
         "code python rust data model token vector search query document answer question paris france "
         "capital london weather today good bad fast slow small large").split()
SUFFIXES = ("s", "ed", "ing", "er", "ly", "es", "tion")
PUNCT = ".,!?;:'\"()-/"


def wordpiece_vocab() -> list[str]:
    """BERT's layout: [PAD] 0, [unusedN] to 99, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103, then
    word-initial pieces ("▁word") and continuation pieces (bare), as llama.cpp's converter writes."""
    tokens = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = "abcdefghijklmnopqrstuvwxyz0123456789"
    tokens += ["\u2581" + c for c in letters + PUNCT] + list(letters)
    tokens += ["\u2581" + w for w in WORDS] + list(SUFFIXES)
    tokens += [a + b for a in "etaoinsr" for b in "etaoinshrdl"]
    return list(dict.fromkeys(tokens))


def write_bert(path: Path, seed: int = 0, reranker: bool = False, qtype: GGMLType = GGMLType.F16,
               n_layer: int = 2, d_model: int = 128, n_head: int = 4, d_ff: int = 512, n_ctx: int = 128,
               nomic: bool = False) -> Path:
    """A BERT encoder; nomic: Nomic's variant (rotary positions, fused QKV, SiLU-gated feed-forward)."""
    tokens = wordpiece_vocab()
    w = gguf.GGUFWriter(str(path), "nomic-bert" if nomic else "bert")
    w.add_name("synthetic")
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx)
    w.add_embedding_length(d_model)
    w.add_feed_forward_length(d_ff)
    w.add_head_count(n_head)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.RANK if reranker else gguf.PoolingType.MEAN if nomic else gguf.PoolingType.CLS)
    if nomic:
        w.add_rope_freq_base(1000.0)
    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("[") else 1 for t in tokens])
    w.add_token_type_count(2)
    w.add_bos_token_id(101)
    w.add_sep_token_id(102)
    w.add_unk_token_id(100)
    w.add_pad_token_id(0)
    w.add_mask_token_id(103)
    t = Writer(w, seed)
    std = 1.0 / np.sqrt(d_model)
    t.matrix("token_embd.weight", len(tokens), d_model, 1.0, qtype)
    t.matrix("token_types.weight", 2, d_model, 0.3, GGMLType.F32)
    if not nomic:
        t.matrix("position_embd.weight", n_ctx, d_model, 0.3, GGMLType.F32)
    t.vector("token_embd_norm.weight", d_model)
    t.vector("token_embd_norm.bias", d_model, 0.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        if nomic:
            t.matrix(p + "attn_qkv.weight", 3 * d_model, d_model, 2.0 * std, qtype)
            t.matrix(p + "attn_output.weight", d_model, d_model, std, qtype)
        else:
            for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
                t.matrix(p + name + ".weight", d_model, d_model, 2.0 * std if name != "attn_output" else std, qtype)
                t.vector(p + name + ".bias", d_model, 0.0)
        t.vector(p + "attn_output_norm.weight", d_model)
        t.vector(p + "attn_output_norm.bias", d_model, 0.0)
        t.matrix(p + "ffn_up.weight", d_ff, d_model, std, qtype)
        t.matrix(p + "ffn_down.weight", d_model, d_ff, 1.0 / np.sqrt(d_ff), qtype)
        if nomic:
            t.matrix(p + "ffn_gate.weight", d_ff, d_model, 4.0 * std, qtype)
        else:
            t.vector(p + "ffn_up.bias", d_ff, 0.0)
            t.vector(p + "ffn_down.bias", d_model, 0.0)
        t.vector(p + "layer_output_norm.weight", d_model)
        t.vector(p + "layer_output_norm.bias", d_model, 0.0)
    if reranker:
        t.matrix("cls.weight", d_model, d_model, std, GGMLType.F32)
        t.vector("cls.bias", d_model, 0.0)
        t.matrix("cls.output.weight", 1, d_model, 1.0, GGMLType.F32)
        t.vector("cls.output.bias", 1, 0.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


RERANK_TEMPLATE = "<|im_start|>system\nJudge whether the Document meets the Query.<|im_end|>\n" \
                  "<|im_start|>user\n<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n"


def write_qwen3_reranker(path: Path, seed: int = 0) -> Path:
    """tests/families.py's qwen3 with rank pooling, a two-label head ("yes", "no") and a rerank template, every matrix F16."""
    extra = {"qwen3.pooling_type": 4, "tokenizer.chat_template.rerank": RERANK_TEMPLATE}

    def more(w: gguf.GGUFWriter, t: Writer, d_model: int) -> None:
        w.add_array("qwen3.classifier.output_labels", ["yes", "no"])
        t.matrix("cls.output.weight", 2, d_model, 0.5, GGMLType.F32)

    return write_family(path, "qwen3", seed=seed, f16=True, extra_metadata=extra, extra_tensors=more)


FIM_IDS = {"tokenizer.ggml.fim_pre_token_id": 8, "tokenizer.ggml.fim_suf_token_id": 9,
           "tokenizer.ggml.fim_mid_token_id": 10, "tokenizer.ggml.fim_sep_token_id": 5}


def write_fim_model(path: Path, seed: int = 0) -> Path:
    """tests/families.py's qwen2 whose vocabulary names FIM tokens (SmolLM2's <issue_start>,
    <issue_comment>, <issue_closed> as prefix, suffix and middle, <file_sep> as file separator;
    <reponame> is found by its text)."""
    return write_family(path, "qwen2", seed=seed, extra_metadata=FIM_IDS)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    write_bert(out / "bert.gguf")
    write_bert(out / "bert-rerank.gguf", reranker=True)
    write_bert(out / "nomic-bert.gguf", nomic=True)
    write_qwen3_reranker(out / "qwen3-rerank.gguf")
    write_fim_model(out / "fim.gguf")
