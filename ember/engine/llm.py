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
from typing import Iterable, Iterator

import numpy as np

from .. import hub
from ..backends import AttentionBatch, get_backend
from ..gguf_loader import GGUFFile
from ..models import Step, load_model
from ..sampler import Sampler, SamplingParams, log_softmax
from ..tokenizer import Tokenizer
from ..tokenizer.chat import ChatTemplate

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

    def _run(self, ids: list[int], start: int, rows: np.ndarray) -> np.ndarray:
        """Compute ids[start:] on top of the cached ids[:start]; logits after each position in `rows`."""
        del self._cached[start:]
        outs = [np.zeros((0, self.model.n_vocab), np.float32)]
        for s in range(start, len(ids), self.n_batch):
            chunk = ids[s:s + self.n_batch]
            want = rows[(rows >= s) & (rows < s + len(chunk))] - s
            outs.append(self._step(chunk, s, want))
            self._cached.extend(chunk)
        return np.concatenate(outs)

    def _prefill(self, ids: list[int]) -> tuple[np.ndarray, int]:
        """Bring the cache to hold `ids`, reusing the common prefix with what it holds.
        Returns the logits after the last token and how many tokens were reused."""
        self._check_fits(len(ids))
        reuse = min(_common_prefix(self._cached, ids), len(ids) - 1)  # recompute >= 1 token for its logits
        return self._run(ids, reuse, np.array([len(ids) - 1]))[0], reuse

    def evaluate(self, ids: list[int], rows: np.ndarray | None = None) -> np.ndarray:
        """Logits (len(rows), n_vocab) after each position in `rows` (default: all) of `ids`,
        evaluated from an empty context."""
        self._check_fits(len(ids))
        rows = np.arange(len(ids)) if rows is None else np.asarray(rows)
        return self._run(list(ids), 0, rows)

    def _decode(self, token: int) -> np.ndarray:
        logits = self._step([token], len(self._cached), np.zeros(1))[0]
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
               ignore_eos: bool = False) -> "Generation":
        """Generate token by token: iterate the result; it records why it stopped and its timings."""
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        return Generation(self, self.prompt_ids(prompt), max_tokens, Sampler(sampling or SamplingParams()),
                          ignore_eos)

    def generate(self, prompt: str | list[int], max_tokens: int = 128, sampling: SamplingParams | None = None,
                 stop: Iterable[str] = (), ignore_eos: bool = False) -> Completion:
        """A whole completion; stops at an end-of-generation token, a stop string or max_tokens."""
        gen = self.stream(prompt, max_tokens, sampling, ignore_eos)
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
        lp = log_softmax(self.evaluate(ids, np.arange(len(ids) - 1)))
        actual = lp[np.arange(len(ids) - 1), np.asarray(ids[1:])]
        top_ids = np.argsort(-lp, axis=1)[:, :top]
        return TokenScores(actual, top_ids, np.take_along_axis(lp, top_ids, axis=1))

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

    def __init__(self, llm: LLM, prompt_ids: list[int], max_tokens: int, sampler: Sampler, ignore_eos: bool):
        self.llm, self.prompt_ids, self.max_tokens = llm, prompt_ids, max_tokens
        self.sampler, self.ignore_eos = sampler, ignore_eos
        self.finish_reason: str | None = None
        self.timings = Timings(prompt_tokens=len(prompt_ids))
        self._decoder = llm.tokenizer.stream_decoder()

    def __iter__(self) -> Iterator[GeneratedToken]:
        llm, t = self.llm, self.timings
        t0 = time.perf_counter()
        logits, t.cached_tokens = llm._prefill(self.prompt_ids)
        t.prompt_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(self.max_tokens):
            token = self.sampler(logits)
            if token in llm.tokenizer.eog_ids and not self.ignore_eos:
                self.finish_reason = "stop"
                return
            t.generated_tokens += 1
            yield GeneratedToken(token, self._decoder.feed(token), float(log_softmax(logits)[token]))
            if i + 1 == self.max_tokens or len(llm._cached) >= llm.n_ctx:
                break
            logits = llm._decode(token)
            t.generation_s = time.perf_counter() - t0
        self.finish_reason = "length"

    def flush(self) -> str:
        """Text held back because it ended inside a UTF-8 sequence (at most a replacement char)."""
        return self._decoder.flush()

def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _find_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None
