"""The embedding API: load a model, tokenize, generate, score.

One `LLM` runs one sequence at a time over a paged KV cache; it keeps the tokens of
the last request cached, so a follow-up that extends the same prompt (a chat turn)
only computes the new tokens.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np

from .. import hub
from ..backends import AttentionBatch, get_backend
from ..gguf_loader import GGUFFile
from ..models import Step, load_model
from ..sampler import Sampler, SamplerVocab, SamplingParams
from ..tokenizer import Tokenizer
from ..tokenizer.chat import ChatTemplate

if TYPE_CHECKING:
    from .perplexity import PerplexityResult

PAGE_SIZE = 256


class ContextOverflow(ValueError):
    """The request does not fit the context window."""


@dataclass(slots=True)
class Timings:
    load_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the previous request
    prompt_s: float = 0.0
    generated_tokens: int = 0
    generation_s: float = 0.0

    @property
    def prompt_tps(self) -> float:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        # the first token comes out of the prompt pass; the rate counts the decode steps after it
        steps = self.generated_tokens - 1
        return steps / self.generation_s if self.generation_s > 0 and steps > 0 else 0.0


@dataclass(slots=True)
class GeneratedToken:
    id: int
    text: str  # the new complete UTF-8 text this token adds (may be empty)
    logprob: float


@dataclass(slots=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-generation token or stop string) or "length"
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)


@dataclass(slots=True)
class TokenScores:
    """Teacher-forced scores: for each position i >= 1, how the model rated token i given 0..i-1."""

    logprobs: np.ndarray  # (n-1,) log-probability of the actual next token
    top_ids: np.ndarray  # (n-1, k) most likely next tokens
    top_logprobs: np.ndarray  # (n-1, k)


class LLM:
    """A GGUF model ready to generate. `model` is a path or a known name ("smollm2", "gemma3-270m")."""

    def __init__(self, model: str | os.PathLike = hub.DEFAULT_MODEL, *, device: str = "auto",
                 threads: int | None = None, ctx: int | None = None, batch: int = 512):
        t0 = time.perf_counter()
        self.path = hub.resolve(model)
        self.gguf = GGUFFile(self.path)
        self.backend = get_backend(device, threads=threads)
        self.model = load_model(self.gguf, self.backend)
        self.tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
        self.chat_template = ChatTemplate.from_metadata(self.gguf.metadata)
        self.sampler_vocab = SamplerVocab.from_tokenizer(self.tokenizer)  # shared by every request's sampler
        self.n_ctx = ctx or min(4096, self.model.n_ctx_train or 4096)
        if self.n_ctx < 1 or batch < 1:
            raise ValueError(f"ctx and batch must be positive (got ctx={ctx}, batch={batch})")
        self.n_batch = batch
        n_pages = math.ceil(self.n_ctx / PAGE_SIZE)
        self.cache = self.model.new_kv_cache(n_pages, PAGE_SIZE)
        self._page_table = np.arange(n_pages, dtype=np.int32)[None, :]
        self._cached: list[int] = []  # tokens whose KV is in the cache, in order
        self.load_s = time.perf_counter() - t0

    # ---- text ----
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Iterable[int], special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), special=special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kw) -> str:
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **kw)

    def chat_ids(self, messages: list[dict], **kw) -> list[int]:
        """Prompt ids of a conversation: the rendered template, special tokens parsed,
        without a second BOS when the template writes one itself."""
        return self.chat_template.encode(self.tokenizer, self.apply_chat_template(messages, **kw))

    # ---- forward passes ----
    def _step(self, tokens: list[int], start: int, output_rows: np.ndarray) -> np.ndarray:
        positions = np.arange(start, start + len(tokens), dtype=np.int32)
        slots = (self._page_table[0][positions // PAGE_SIZE].astype(np.int64) * PAGE_SIZE
                 + positions % PAGE_SIZE)
        attn = AttentionBatch(positions, np.zeros(len(tokens), np.int32), self._page_table, slots, PAGE_SIZE)
        step = Step(np.asarray(tokens, np.int32), attn, output_rows.astype(np.int32))
        return self.model.forward(step, self.cache)

    def _check_fits(self, n: int) -> None:
        if n > self.n_ctx:
            raise ContextOverflow(f"{n} tokens do not fit the context of {self.n_ctx} tokens")

    def _pieces(self, ids: list[int], start: int, rows: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Compute ids[start:] on top of the cached ids[:start], yielding (logits, positions) for the
        positions in `rows`. Pieces are cut so that each step's logits fit the model's buffer; the
        logits are a view valid until the next step."""
        del self._cached[start:]
        rows = np.sort(np.asarray(rows, np.int64))
        limit = self.model.max_output_rows
        s = start
        while s < len(ids):
            end = min(s + self.n_batch, len(ids))
            want = rows[(rows >= s) & (rows < end)]
            if len(want) > limit:
                end = int(want[limit - 1]) + 1  # stop right after the last row that fits
                want = want[:limit]
            logits = self._step(ids[s:end], s, want - s)
            self._cached.extend(ids[s:end])
            if len(want):
                yield logits, want
            s = end

    def _prefill(self, ids: list[int]) -> tuple[np.ndarray, int]:
        """Bring the cache to hold `ids`, reusing the common prefix with what it holds.
        Returns the logits after the last token (a copy) and how many tokens were reused."""
        self._check_fits(len(ids))
        reuse = min(_common_prefix(self._cached, ids), len(ids) - 1)  # recompute >= 1 token for its logits
        (logits, _), = self._pieces(ids, reuse, np.array([len(ids) - 1]))
        return logits[0].copy(), reuse

    def evaluate(self, ids: list[int], rows=None, reduce=None) -> list:
        """Evaluate `ids` from an empty context. For the positions in `rows` (default: all),
        `reduce(logits, positions)` is called on each piece of logits (n, n_vocab) and its results
        are returned in a list (default: copies of the logits)."""
        self._check_fits(len(ids))
        rows = np.arange(len(ids)) if rows is None else rows
        reduce = reduce or (lambda logits, positions: logits.copy())
        return [reduce(logits, pos) for logits, pos in self._pieces(list(ids), 0, rows)]

    def _decode(self, token: int) -> np.ndarray:
        logits = self._step([token], len(self._cached), np.zeros(1))[0].copy()
        self._cached.append(token)
        return logits

    # ---- generation ----
    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A str prompt is tokenized with BOS and with special tokens parsed (as llama.cpp does)."""
        ids = self.tokenize(prompt, add_special=True, parse_special=True) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.model.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.model.n_vocab - 1})")
        return ids

    def stream(self, prompt: str | list[int], max_tokens: int = 128, sampling: SamplingParams | None = None,
               ) -> "Generation":
        """Generate token by token: iterate the result; it records why it stopped and its timings."""
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        sampler = Sampler(sampling or SamplingParams(), vocab=self.sampler_vocab, n_ctx=self.n_ctx)
        return Generation(self, self.prompt_ids(prompt), max_tokens, sampler)

    def generate(self, prompt: str | list[int], max_tokens: int = 128, sampling: SamplingParams | None = None,
                 stop: Iterable[str] = ()) -> Completion:
        """A whole completion; stops at an end-of-generation token, a stop string or max_tokens."""
        gen = self.stream(prompt, max_tokens, sampling)
        stops = [s for s in stop if s]
        text, ids = "", []
        for tok in gen:
            ids.append(tok.id)
            text += tok.text
            cut = _find_stop(text, stops)
            if cut is not None:
                text, gen.finish_reason = text[:cut], "stop"
                break
        text += gen.flush()
        gen.timings.load_s = self.load_s
        return Completion(text, ids, gen.finish_reason or "length", len(gen.prompt_ids), gen.timings)

    def chat(self, messages: list[dict], max_tokens: int = 256, sampling: SamplingParams | None = None,
             **kw) -> Completion:
        return self.generate(self.chat_ids(messages), max_tokens, sampling, **kw)

    # ---- scoring ----
    def score(self, ids: list[int], top: int = 10) -> TokenScores:
        """Teacher-forced log-probabilities of each token after the first, with the top alternatives."""
        if len(ids) < 2:
            raise ValueError("scoring needs at least two tokens")
        targets = np.asarray(ids)

        def reduce(logits, positions):
            lp = log_softmax32(logits)
            top_ids = np.argsort(-lp, axis=1)[:, :top]
            return (lp[np.arange(len(lp)), targets[positions + 1]], top_ids, np.take_along_axis(lp, top_ids, 1))

        parts = self.evaluate(ids, np.arange(len(ids) - 1), reduce)
        return TokenScores(*(np.concatenate(p) for p in zip(*parts)))

    def perplexity(self, text: str, ctx: int = 512) -> "PerplexityResult":
        """llama-perplexity's measure: chunks of `ctx` tokens, BOS first when the model adds one,
        only the second half of each chunk scored."""
        from .perplexity import perplexity

        return perplexity(self, text, ctx)

    def close(self) -> None:
        self.gguf.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Generation:
    """One running generation: iterate for tokens; `finish_reason` is set when it ends
    ("stop": end-of-generation token or stop string, "length": max_tokens or context full)."""

    def __init__(self, llm: LLM, prompt_ids: list[int], max_tokens: int, sampler: Sampler):
        self.llm, self.prompt_ids, self.max_tokens = llm, prompt_ids, max_tokens
        self.sampler = sampler
        self.finish_reason: str | None = None
        self.timings = Timings(prompt_tokens=len(prompt_ids))
        self._decoder = llm.tokenizer.stream_decoder()

    def __iter__(self) -> Iterator[GeneratedToken]:
        llm, t = self.llm, self.timings
        t0 = time.perf_counter()
        logits, t.cached_tokens = llm._prefill(self.prompt_ids)
        t.prompt_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.sampler.accept_many(self.prompt_ids)  # penalties see the prompt, as in llama-server
        for i in range(self.max_tokens):
            token = self.sampler.sample(logits)
            self.sampler.accept(token)
            if token in llm.tokenizer.eog_ids:  # never sampled under ignore_eos, which bans them
                self.finish_reason = "stop"
                return
            t.generated_tokens += 1
            yield GeneratedToken(token, self._decoder.feed(token), self.sampler.logprobs(token, n=0).logprob)
            if i + 1 == self.max_tokens or len(llm._cached) >= llm.n_ctx:
                break
            logits = llm._decode(token)
            t.generation_s = time.perf_counter() - t0
        self.finish_reason = "length"

    def flush(self) -> str:
        """Text held back because it ended inside a UTF-8 sequence (at most a replacement char)."""
        return self._decoder.flush()

def log_softmax32(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities in float32 (a scoring pass over a large vocabulary)."""
    z = logits - logits.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _find_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None
