"""KL divergence of a model against a base model's logits, as llama-perplexity measures it.

The logits file is llama-perplexity's (`--kl-divergence-base`): b"_logits_", u32 n_ctx, i32 n_vocab,
i32 n_chunk, i32 tokens[n_chunk * n_ctx], then per chunk one record per scored position (the
second half of the chunk but its last token, n_ctx - 1 - n_ctx/2 of them): two f32 (scale and the
lowest log-probability kept) and n_vocab u16 (rounded up to an even count) with
log p = scale * u16 + lowest; log-probabilities more than 16 below the best are stored as 0.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MAGIC = b"_logits_"
FLOOR = 16.0  # stored log-probabilities span at most this far below the best


class LogitsFileError(ValueError):
    pass


def record_width(n_vocab: int) -> int:
    """u16 values per stored position: 4 for the two floats, the vocabulary rounded up to even."""
    return 2 * ((n_vocab + 1) // 2) + 4


@dataclass(slots=True)
class BaseLogits:
    """A logits file opened for reading (tokens in memory, records mapped)."""

    path: Path
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray  # (n_chunk * n_ctx,) int32
    records: np.ndarray  # (n_chunk, n_scored, width) uint16, memory-mapped

    @property
    def n_scored(self) -> int:
        return self.n_ctx - 1 - self.n_ctx // 2

    def chunk_tokens(self, c: int) -> list[int]:
        return self.tokens[c * self.n_ctx:(c + 1) * self.n_ctx].tolist()

    def log_probs(self, c: int) -> np.ndarray:
        """(n_scored, n_vocab) float32 log-probabilities of chunk c's scored positions."""
        return decode(self.records[c], self.n_vocab)


def open_base(path) -> BaseLogits:
    """Read a logits file's header and map its records; a short or foreign file is one clear error."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(20)
    if len(head) < 20 or head[:8] != MAGIC:
        raise LogitsFileError(f"{path} is not a llama-perplexity logits file (no '_logits_' header)")
    n_ctx, n_vocab, n_chunk = struct.unpack("<Iii", head[8:20])
    if n_ctx < 4 or n_vocab < 1 or n_chunk < 1:
        raise LogitsFileError(f"{path}: invalid header (n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk})")
    n_scored, width = n_ctx - 1 - n_ctx // 2, record_width(n_vocab)
    tokens_end = 20 + 4 * n_chunk * n_ctx
    need = tokens_end + 2 * n_chunk * n_scored * width
    if size < need:
        raise LogitsFileError(f"{path} is truncated: {size} bytes, {need} needed for {n_chunk} chunks of {n_ctx} "
                              f"tokens over {n_vocab} tokens of vocabulary ({need - size} bytes missing)")
    tokens = np.fromfile(path, np.int32, n_chunk * n_ctx, offset=20)
    records = np.memmap(path, np.uint16, "r", tokens_end, (n_chunk, n_scored, width))
    return BaseLogits(path, n_ctx, n_vocab, n_chunk, tokens, records)


def decode(records: np.ndarray, n_vocab: int) -> np.ndarray:
    """(m, width) uint16 records -> (m, n_vocab) float32 log-probabilities."""
    head = np.ascontiguousarray(records[:, :4]).view(np.float32)  # (m, 2): scale, lowest
    return records[:, 4:4 + n_vocab].astype(np.float32) * head[:, :1] + head[:, 1:2]


def encode(logits: np.ndarray) -> np.ndarray:
    """(m, n_vocab) logits -> (m, width) uint16 records, as llama-perplexity stores them."""
    m, n_vocab = logits.shape
    logits = logits.astype(np.float32)
    top = logits.max(axis=1, keepdims=True)
    low = np.maximum(logits.min(axis=1, keepdims=True), top - FLOOR)
    lse = np.log(np.exp(logits - top).astype(np.float64).sum(axis=1, keepdims=True)).astype(np.float32)
    scale = (top - low) / np.float32(65535)
    out = np.zeros((m, record_width(n_vocab)), np.uint16)
    out[:, :4] = np.concatenate([scale, low - top - lse], axis=1).astype(np.float32).view(np.uint16)
    safe = np.where(scale > 0, scale, 1)
    q = np.rint((logits - low) / safe)
    out[:, 4:4 + n_vocab] = np.where((logits > low) & (scale > 0), q, 0).astype(np.uint16)
    return out


def write_base(path, n_ctx: int, n_vocab: int, tokens: list[int], chunks) -> None:
    """A logits file of len(tokens) // n_ctx chunks; `chunks` yields each chunk's (n_scored, n_vocab)
    logits in turn."""
    n_chunk = len(tokens) // n_ctx
    with open(path, "wb") as fh:
        fh.write(MAGIC + struct.pack("<Iii", n_ctx, n_vocab, n_chunk))
        fh.write(np.asarray(tokens[:n_chunk * n_ctx], np.int32).tobytes())
        for logits in chunks:
            fh.write(encode(logits).tobytes())


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


@dataclass(slots=True)
class KldStats:
    """Per scored token: the model's and the base's negative log-likelihood of the next token, the KL
    divergence of the model from the base, the probability difference, whether the best ids agree."""

    nll: list = field(default_factory=list)
    nll_base: list = field(default_factory=list)
    kld: list = field(default_factory=list)
    p_diff: list = field(default_factory=list)
    same_top: list = field(default_factory=list)

    def add(self, logits: np.ndarray, base_logp: np.ndarray, targets: np.ndarray) -> None:
        """logits (m, n_vocab) of the model; base_logp (m, n_vocab); targets (m,) the next tokens."""
        logq = log_softmax(logits)
        rows = np.arange(len(targets))
        nll, nll_base = -logq[rows, targets], -base_logp[rows, targets].astype(np.float64)
        kept = base_logp > -FLOOR  # as llama-perplexity sums: tokens the base gives a chance
        p_base = np.where(kept, np.exp(base_logp.astype(np.float64)), 0.0)
        self.kld.extend((p_base * (base_logp - logq)).sum(axis=1).tolist())
        self.nll.extend(nll.tolist())
        self.nll_base.extend(nll_base.tolist())
        self.p_diff.extend((np.exp(-nll) - np.exp(-nll_base)).tolist())
        self.same_top.extend((logits.argmax(axis=1) == base_logp.argmax(axis=1)).tolist())

    @property
    def count(self) -> int:
        return len(self.kld)

    @property
    def mean_kld(self) -> float:
        return float(np.mean(self.kld))

    @property
    def same_top_fraction(self) -> float:
        return float(np.mean(self.same_top))


def mean_and_uncertainty(values) -> tuple[float, float]:
    v = np.asarray(values, np.float64)
    if len(v) == 0:
        return 0.0, 0.0
    mean, var = v.mean(), (v * v).mean() - v.mean() ** 2
    return float(mean), float(math.sqrt(var / (len(v) - 1))) if var > 0 and len(v) > 10 else 0.0


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama-perplexity's interpolated percentile of sorted values."""
    p = fraction * (len(sorted_values) - 1)
    i = int(p)
    return float((1 - (p - i)) * sorted_values[i] + (p - i) * sorted_values[min(i + 1, len(sorted_values) - 1)])


def report(s: KldStats) -> str:
    """The statistics llama-perplexity --kl-divergence prints, in its layout."""
    lp, lpb = mean_and_uncertainty(s.nll), mean_and_uncertainty(s.nll_base)
    n = s.count
    cov = (np.dot(s.nll, s.nll_base) / n - lp[0] * lpb[0]) / (n - 1) if n >= 10 else 0.0
    ratio = lp[0] - lpb[0]
    ratio_unc = math.sqrt(max(lp[1] ** 2 + lpb[1] ** 2 - 2 * cov, 0.0))
    ppl, ppl_base = math.exp(lp[0]), math.exp(lpb[0])
    cor = cov / (lp[1] * lpb[1]) if lp[1] * lpb[1] > 0 else 0.0
    kld, pd = np.sort(s.kld), np.sort(s.p_diff)
    mk, mp = mean_and_uncertainty(s.kld), mean_and_uncertainty(s.p_diff)
    msq = mean_and_uncertainty(np.square(s.p_diff))
    rms = math.sqrt(msq[0])
    top = s.same_top_fraction
    lines = ["====== Perplexity statistics ======",
             f"Mean PPL(Q)                   : {ppl:10.6f} ± {ppl * lp[1]:10.6f}",
             f"Mean PPL(base)                : {ppl_base:10.6f} ± {ppl_base * lpb[1]:10.6f}",
             f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * cor:6.2f}%",
             f"Mean ln(PPL(Q)/PPL(base))     : {ratio:10.6f} ± {ratio_unc:10.6f}",
             f"Mean PPL(Q)/PPL(base)         : {math.exp(ratio):10.6f} ± {math.exp(ratio) * ratio_unc:10.6f}",
             f"Mean PPL(Q)-PPL(base)         : {ppl - ppl_base:10.6f}",
             "", "====== KL divergence statistics ======",
             f"Mean    KLD: {mk[0]:10.6f} ± {mk[1]:10.6f}", f"Maximum KLD: {kld[-1]:10.6f}"]
    for label, frac in (("99.9%", .999), ("99.0%", .99), ("95.0%", .95), ("90.0%", .9)):
        lines.append(f"{label}   KLD: {percentile(kld, frac):10.6f}")
    lines.append(f"Median  KLD: {percentile(kld, 0.5):10.6f}")
    for label, frac in (("10.0%", .1), (" 5.0%", .05), (" 1.0%", .01), (" 0.1%", .001)):
        lines.append(f"{label}   KLD: {percentile(kld, frac):10.6f}")
    lines += [f"Minimum KLD: {kld[0]:10.6f}", "", "====== Token probability statistics ======",
              f"Mean    Δp: {100 * mp[0]:6.3f} ± {100 * mp[1]:5.3f} %", f"Maximum Δp: {100 * pd[-1]:6.3f}%"]
    for label, frac in (("99.9%", .999), ("99.0%", .99), ("95.0%", .95), ("90.0%", .9), ("75.0%", .75)):
        lines.append(f"{label}   Δp: {100 * percentile(pd, frac):6.3f}%")
    lines.append(f"Median  Δp: {100 * percentile(pd, 0.5):6.3f}%")
    for label, frac in (("25.0%", .25), ("10.0%", .1), (" 5.0%", .05), (" 1.0%", .01), (" 0.1%", .001)):
        lines.append(f"{label}   Δp: {100 * percentile(pd, frac):6.3f}%")
    lines += [f"Minimum Δp: {100 * pd[0]:6.3f}%",
              f"RMS Δp    : {100 * rms:6.3f} ± {100 * 0.5 / rms * msq[1] if rms > 0 else 0.0:5.3f} %",
              f"Same top p: {100 * top:6.3f} ± {100 * math.sqrt(top * (1 - top) / max(n - 1, 1)):5.3f} %"]
    return "\n".join(lines)
