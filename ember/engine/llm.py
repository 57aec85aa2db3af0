"""The embedding API: load a model, tokenize, generate, score.

`LLM` is a convenient front for an `Engine`: every call becomes an engine request, so
calls from several threads run batched together, and every request shares the prefix
cache (a chat turn that extends the previous one computes only the new tokens).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable, Iterator

from .. import hub
from ..backends import get_backend, kv_type
from ..gguf_loader import GGUFFile
from ..models import ModelError, load_model
from ..quant.types import layout
from ..sampler import SamplingParams
from ..tokenizer import Tokenizer
from .engine import Engine, EngineConfig
from .release import ReleasedOnClose
from .requests import FinishEvent, Request, TokenEvent
from .draftmodel import check_vocab
from .speculate import DraftModelConfig, SpecConfig, is_auto, parse_types
from .scoring import PerplexityResult, TokenScores, collect_reduced, perplexity, scores_of, token_scores
from .tiers import TierConfig, file_digest


class ContextOverflow(ValueError):
    """The request does not fit the context window."""


@dataclass(slots=True)
class Timings:
    load_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_s: float = 0.0  # submission to first token
    generated_tokens: int = 0
    generation_s: float = 0.0  # first to last token

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
    logprob: float | None


@dataclass(slots=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-generation token or stop string), "length", "cancelled"
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)


class LLM(ReleasedOnClose):
    """A GGUF model ready to generate. `model` is a path or a known name ("smollm2", "gemma3-270m").

    ctx: longest sequence in tokens; slots: sequences computed at once; batch: tokens computed per
    step; KV cache capacity in tokens (kv_tokens) or bytes (kv_memory), default ctx * slots tokens
    (memory is committed as it is used); max_waiting: queued requests beyond which submitting
    raises QueueFull; decode_ahead: see EngineConfig; cache_type_k/_v: the KV cache's storage types
    (f16, bf16, q8_0, q4_0); cache_ram, cache_disk, cache_disk_size: the tiers below the KV pool in
    bytes of host memory and in a folder of files (tiers.py); hash_file: identify the model by its
    file's hash also without a disk tier (for saved slots); speculative: draft sources and limits
    (SpecConfig, or a `--spec-type` string such as "cache,lookup" or "auto"; default none); model_draft: a
    draft model's file or name (same vocabulary; drafts first, docs/speculative.md)."""

    def __init__(self, model: str | os.PathLike = hub.DEFAULT_MODEL, *, device: str = "auto",
                 threads: int | None = None, ctx: int | None = None, slots: int = 4, batch: int = 512,
                 kv_tokens: int | None = None, kv_memory: int | None = None, max_waiting: int = 1024,
                 prefix_cache: bool = True, decode_ahead: bool | None = None, cache_type_k: str = "f16",
                 cache_type_v: str = "f16", cache_ram: int = 0, cache_disk: str | os.PathLike | None = None,
                 cache_disk_size: int = 0, hash_file: bool = False,
                 speculative: SpecConfig | str | None = None, model_draft: str | os.PathLike | None = None):
        t0 = time.perf_counter()
        self.path = hub.resolve(model)
        self.gguf = GGUFFile(self.path)
        self.draft_gguf = None
        spec = spec_config(speculative, model_draft)
        try:
            self.backend = get_backend(device, threads=threads)
            self.model = load_model(self.gguf, self.backend)
            if not self.model.generates:
                raise ModelError(f"'{self.model.arch}' is an encoder: it gives embeddings, not text (use "
                                 "ember.embeddings(), `ember embed` or `ember serve --embeddings`)")
            self.tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
            self.n_ctx = ctx or min(4096, self.model.n_ctx_train or 4096)
            self.model.set_context(self.n_ctx)
            draft = self._load_draft(spec.model, device, threads) if spec.model is not None else None
            self.engine = Engine(self.model, self.tokenizer, EngineConfig(
                n_ctx=self.n_ctx, max_seqs=slots,
                kv_tokens=kv_tokens or kv_tokens_in(kv_memory, self.model, self.n_ctx, cache_type_k, cache_type_v),
                max_batch_tokens=batch, max_waiting=max_waiting, prefix_cache=prefix_cache, decode_ahead=decode_ahead,
                cache_type_k=cache_type_k, cache_type_v=cache_type_v,
                tiers=TierConfig(cache_ram, None if cache_disk is None else str(cache_disk), cache_disk_size),
                model_digest=file_digest(self.path) if cache_disk is not None or hash_file else b"",
                speculative=spec), draft)
        except BaseException:
            self._close_files()
            raise
        self.load_s = time.perf_counter() - t0

    def _load_draft(self, cfg: DraftModelConfig, device: str, threads: int | None):
        """The draft model, on the model's backend unless it names another device; ModelError
        unless it has the model's vocabulary."""
        self.draft_gguf = GGUFFile(hub.resolve(cfg.path))
        backend = self.backend if cfg.device in (None, device) else get_backend(cfg.device, threads=threads)
        draft = load_model(self.draft_gguf, backend)
        if not draft.generates:
            raise ModelError(f"the draft model '{draft.arch}' is an encoder: it has no tokens to draft")
        check_vocab(self.gguf.metadata, self.draft_gguf.metadata, self.model.n_vocab, draft.n_vocab)
        draft.set_context(min(cfg.n_ctx or self.n_ctx, self.n_ctx))
        return draft

    def _close_files(self) -> None:
        self.gguf.close()
        if self.draft_gguf is not None:
            self.draft_gguf.close()

    @cached_property
    def chat_template(self):
        """The file's chat template (compiled on first use: Jinja costs start-up time otherwise)."""
        from ..tokenizer.chat import ChatTemplate

        return ChatTemplate.from_metadata(self.gguf.metadata)

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

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A str prompt is tokenized with BOS and with special tokens parsed (as llama.cpp does)."""
        ids = self.tokenize(prompt, add_special=True, parse_special=True) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) > self.n_ctx:
            raise ContextOverflow(f"the prompt has {len(ids)} tokens; the context holds {self.n_ctx}")
        return ids

    # ---- generation ----
    def stream(self, prompt: str | list[int], max_tokens: int = 128, sampling: SamplingParams | None = None,
               stop: Iterable[str] = (), logprobs: bool = True) -> "Generation":
        """Generate token by token: iterate the result; it records why it stopped and its timings."""
        request = Request(self.prompt_ids(prompt), max_tokens, sampling or SamplingParams(),
                          stop=tuple(s for s in stop if s), logprobs=0 if logprobs else None)
        return Generation(self, request)

    def generate(self, prompt: str | list[int], max_tokens: int = 128, sampling: SamplingParams | None = None,
                 stop: Iterable[str] = ()) -> Completion:
        """A whole completion; stops at an end-of-generation token, a stop string or max_tokens."""
        gen = self.stream(prompt, max_tokens, sampling, stop, logprobs=False)
        ids, text = [], ""
        for tok in gen:
            ids.append(tok.id)
            text += tok.text
        text += gen.flush()
        gen.timings.load_s = self.load_s
        return Completion(text, ids, gen.finish_reason or "length", len(gen.request.prompt), gen.timings)

    def chat(self, messages: list[dict], max_tokens: int = 256, sampling: SamplingParams | None = None,
             **kw) -> Completion:
        return self.generate(self.chat_ids(messages), max_tokens, sampling, **kw)

    # ---- scoring ----
    def submit_evaluation(self, ids: list[int], reduce, logits_from: int = 0):
        """Queue a run of `ids` from an empty context; `reduce(logits, positions)` is called on each
        piece of logits after the positions >= logits_from. Returns the engine handle."""
        return self.engine.submit(Request(self.prompt_ids(ids), 0, SamplingParams.greedy_params(),
                                          prompt_reduce=reduce, prompt_logits_from=logits_from))

    def evaluate(self, ids: list[int], reduce, logits_from: int = 0) -> list:
        """submit_evaluation, then wait: the results of `reduce`, in position order."""
        return collect_reduced(self.submit_evaluation(ids, reduce, logits_from))

    def score(self, ids: list[int], top: int = 10) -> TokenScores:
        """Teacher-forced log-probabilities of each token after the first, with the top alternatives."""
        if len(ids) < 2:
            raise ValueError("scoring needs at least two tokens")
        return token_scores(self.evaluate(ids, scores_of(ids, top)))

    def perplexity(self, text: str, ctx: int = 512) -> PerplexityResult:
        """llama-perplexity's measure: chunks of `ctx` tokens, BOS first when the model adds one,
        only the second half of each chunk scored."""
        return perplexity(self, text, ctx)

    def close(self) -> None:
        """Stop the engine and give back its memory: the weights (with whatever the backend moved
        them to: huge pages, device buffers), the KV cache and the files' mappings, also while the
        caller keeps this object. Using the model afterwards raises EngineClosed."""
        if self.closed:
            return
        self.engine.close()
        self._close_files()
        self._release(("engine", "model", "backend"))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Generation:
    """One running generation: iterate for tokens; `finish_reason` is set when it ends
    ("stop": end-of-generation token or stop string, "length": max_tokens or context full)."""

    def __init__(self, llm: LLM, request: Request):
        self.request = request
        self.finish_reason: str | None = None
        self.timings = Timings(prompt_tokens=len(request.prompt))
        self._handle = llm.engine.submit(request)
        self._tail = ""

    def __iter__(self) -> Iterator[GeneratedToken]:
        t, t0 = self.timings, time.perf_counter()
        first = last = None
        try:
            for ev in self._handle:
                if isinstance(ev, TokenEvent):
                    last = time.perf_counter()
                    first = first or last
                    t.generated_tokens += 1
                    yield GeneratedToken(ev.token, ev.text, ev.logprob)
                elif isinstance(ev, FinishEvent):
                    self.finish_reason, self._tail = ev.reason, ev.text
                    t.cached_tokens = ev.cached_tokens
                    if ev.error:
                        raise RuntimeError(f"generation failed: {ev.error}")
        finally:
            if self.finish_reason is None:  # the consumer stopped early
                self._handle.cancel()
        if first is not None:
            t.prompt_s, t.generation_s = first - t0, last - first

    def cancel(self) -> None:
        self._handle.cancel()

    def flush(self) -> str:
        """Text held back at the end (incomplete UTF-8, at most a replacement character)."""
        tail, self._tail = self._tail, ""
        return tail


def spec_config(spec: SpecConfig | str | None, model_draft: str | os.PathLike | None = None) -> SpecConfig:
    """The speculative config of LLM's arguments: a draft model given on its own drafts first."""
    model = DraftModelConfig(str(model_draft)) if model_draft is not None else None
    if isinstance(spec, SpecConfig):
        return spec.with_model(model)
    types = parse_types(spec or "")
    if model is not None and "draft" not in types:
        types = ("draft",) + types
    return SpecConfig(types, model=model, auto=is_auto(spec or ""))


def kv_bytes_per_token(model, cache_type_k: str = "f16", cache_type_v: str = "f16") -> int:
    """K and V of every layer in the cache's types (q8_0 rows are 34/64 of f16's, q4_0 rows 18/64)."""
    k_lay, v_lay = layout(kv_type(cache_type_k)), layout(kv_type(cache_type_v))
    return sum(k_lay.row_bytes(k) + v_lay.row_bytes(v) for k, v in model.kv_dims())


def kv_tokens_in(kv_memory: int | None, model, n_ctx: int, cache_type_k: str = "f16",
                 cache_type_v: str = "f16") -> int | None:
    """A KV cache budget in bytes -> its capacity in tokens (None: the engine's default)."""
    if kv_memory is None:
        return None
    per_token = kv_bytes_per_token(model, cache_type_k, cache_type_v)
    tokens = kv_memory // per_token
    if tokens < n_ctx:
        raise ValueError(f"a KV cache of {kv_memory} bytes holds {tokens} tokens ({per_token} bytes each); "
                         f"one context of {n_ctx} tokens needs {n_ctx * per_token} bytes")
    return tokens
