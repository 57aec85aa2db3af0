"""Scoring a text with the model: teacher-forced log-probabilities of each token, and perplexity
measured the way llama-perplexity does, so the numbers compare.

For perplexity the text is tokenized once (BOS first when the model adds one) and cut into chunks
of `ctx` tokens; each chunk is evaluated on its own with its first token replaced by BOS (when
the model uses one), and only the predictions in the second half of each chunk are scored, so
every scored token has at least ctx/2 tokens of context.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from .requests import FinishEvent, PromptEvent


@dataclass(slots=True)
class TokenScores:
    """Teacher-forced scores: for each position i >= 1, how the model rated token i given 0..i-1."""

    logprobs: np.ndarray  # (n-1,) log-probability of the actual next token
    top_ids: np.ndarray  # (n-1, k) most likely next tokens
    top_logprobs: np.ndarray  # (n-1, k)


def scores_of(ids: list[int], top: int):
    """Reducer: the log-probability of the token after each position (the last has none) and the
    top alternatives; concatenated by `token_scores`."""
    targets = np.asarray(ids)

    def reduce(logits, positions):
        keep = positions < len(ids) - 1
        lp, positions = log_softmax32(logits[keep]), positions[keep]
        top_ids = np.argsort(-lp, axis=1)[:, :top]
        return lp[np.arange(len(lp)), targets[positions + 1]], top_ids, np.take_along_axis(lp, top_ids, 1)

    return reduce


def token_scores(parts: list) -> TokenScores:
    return TokenScores(*(np.concatenate(p) for p in zip(*parts)))


def collect_reduced(handle) -> list:
    """Values of a request's prompt_reduce, in order; an engine failure is raised."""
    out = []
    for ev in handle:
        if isinstance(ev, PromptEvent):
            out.append(ev.value)
        elif isinstance(ev, FinishEvent) and ev.error:
            raise RuntimeError(f"evaluation failed: {ev.error}")
    return out


def log_softmax32(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities in float32 (a scoring pass over a large vocabulary)."""
    z = logits - logits.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


@dataclass(slots=True)
class PerplexityResult:
    ppl: float
    stderr: float  # of the mean negative log-likelihood, propagated to the perplexity
    chunks: int
    scored_tokens: int
    seconds: float


def perplexity(llm, text: str, ctx: int = 512) -> PerplexityResult:
    """llama-perplexity's measure of `text` on an LLM (see the module doc)."""
    if ctx < 4:
        raise ValueError(f"perplexity needs chunks of at least 4 tokens, got {ctx}")
    if ctx > llm.n_ctx:
        raise ValueError(f"chunks of {ctx} tokens exceed the context of {llm.n_ctx}")
    tokens = llm.tokenize(text, add_special=True, parse_special=False)
    n_chunks = len(tokens) // ctx
    if n_chunks == 0:
        raise ValueError(f"the text has {len(tokens)} tokens; at least {ctx} are needed for one chunk")
    first = ctx // 2
    bos = llm.tokenizer.bos_id if llm.tokenizer.add_bos else None
    t0 = time.perf_counter()
    handles = []  # every chunk at once: the engine batches them
    for c in range(n_chunks):
        chunk = tokens[c * ctx:(c + 1) * ctx]
        if bos is not None:
            chunk[0] = bos
        handles.append(llm.submit_evaluation(chunk, _nll_of(chunk), logits_from=first))
    nll = [np.concatenate(collect_reduced(h)) for h in handles]
    nll = np.concatenate(nll)
    mean = float(nll.mean())
    stderr = float(nll.std() / math.sqrt(len(nll))) if len(nll) > 1 else 0.0
    ppl = math.exp(mean)
    return PerplexityResult(ppl, ppl * stderr, n_chunks, len(nll), time.perf_counter() - t0)


def _nll_of(chunk: list[int]):
    """Reducer: negative log-likelihood of the token after each position (the last has none)."""
    targets = np.asarray(chunk)

    def reduce(logits, positions):
        keep = positions < len(chunk) - 1
        lp = log_softmax32(logits[keep])
        return -lp[np.arange(len(lp)), targets[positions[keep] + 1]]

    return reduce


def chunk_logits(llm, chunk: list[int], first: int):
    """Handle of the run of one chunk whose reduced values are the logits (rows, n_vocab) of
    positions first .. len(chunk) - 2 (those that predict a token of the chunk)."""
    def keep(logits, positions):
        return np.array(logits[positions < len(chunk) - 1], np.float32)

    return llm.submit_evaluation(chunk, keep, logits_from=first)


def chunks_of(llm, tokens: list[int], ctx: int) -> list[list[int]]:
    """The chunks llama-perplexity evaluates: whole chunks of ctx tokens, the first of each replaced
    by BOS when the model adds one."""
    bos = llm.tokenizer.bos_id if llm.tokenizer.add_bos else None
    chunks = [list(tokens[c * ctx:(c + 1) * ctx]) for c in range(len(tokens) // ctx)]
    for chunk in chunks:
        if bos is not None:
            chunk[0] = bos
    return chunks


def save_base_logits(llm, text: str, ctx: int, path, chunks: int | None = None) -> PerplexityResult:
    """Perplexity of `text` as `perplexity` measures it, writing every scored position's
    log-probabilities to `path` in llama-perplexity's logits-file format (--kl-divergence-base)."""
    from .kld import write_base

    if ctx < 4 or ctx > llm.n_ctx:
        raise ValueError(f"chunks of {ctx} tokens: need 4 to {llm.n_ctx}")
    tokens = llm.tokenize(text, add_special=True, parse_special=False)
    if len(tokens) < ctx:
        raise ValueError(f"the text has {len(tokens)} tokens; at least {ctx} are needed for one chunk")
    if chunks is not None:
        if chunks < 1:
            raise ValueError(f"chunks must be at least 1, got {chunks}")
        tokens = tokens[:chunks * ctx]
    t0, first, nll = time.perf_counter(), ctx // 2, []

    def logits_per_chunk():
        for chunk in chunks_of(llm, tokens, ctx):
            logits = np.concatenate(collect_reduced(chunk_logits(llm, chunk, first)))
            lp = log_softmax32(logits)
            nll.append(-lp[np.arange(len(lp)), np.asarray(chunk[first + 1:])])
            yield logits

    write_base(path, ctx, llm.model.n_vocab, tokens, logits_per_chunk())
    nll = np.concatenate(nll)
    ppl = math.exp(float(nll.mean()))
    stderr = float(nll.std() / math.sqrt(len(nll))) if len(nll) > 1 else 0.0
    return PerplexityResult(ppl, ppl * stderr, len(tokens) // ctx, len(nll), time.perf_counter() - t0)


def kl_divergence(llm, base, chunks: int | None = None):
    """KldStats of the model against a base logits file (kld.open_base), over its chunks (the first
    `chunks` of them where given), evaluated as llama-perplexity does."""
    from .kld import KldStats

    if base.n_vocab != llm.model.n_vocab:
        raise ValueError(f"the logits file has a vocabulary of {base.n_vocab} tokens, the model {llm.model.n_vocab}")
    if base.n_ctx > llm.n_ctx:
        raise ValueError(f"the logits file was computed with chunks of {base.n_ctx} tokens; the context is {llm.n_ctx}")
    stats, first = KldStats(), base.n_ctx // 2
    n = base.n_chunk if chunks is None else min(chunks, base.n_chunk)
    all_tokens = base.tokens.tolist()
    for c, chunk in enumerate(chunks_of(llm, all_tokens[:n * base.n_ctx], base.n_ctx)):
        logits = np.concatenate(collect_reduced(chunk_logits(llm, chunk, first)))
        targets = np.asarray(all_tokens[c * base.n_ctx + first + 1:(c + 1) * base.n_ctx])
        stats.add(logits, base.log_probs(c), targets)
    return stats
