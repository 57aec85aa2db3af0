"""The engine: one loop thread owns the model and runs steps for every request at once.

Callers submit requests from any thread (`submit`) or from asyncio (`submit_async`); each
request's events stream back through its handle (requests.py); a handle can be cancelled at any
time and its sequence leaves within one step. A step is: plan (the scheduler), run (the model
runner), post-process (output.py: tokens, texts, events).

On a device that runs a step while the host goes on (a GPU), the events a step produces wait in
the outbox and are handed to their callers once the next step is launched: waking a caller's
thread (and that thread taking the interpreter lock) then overlaps the device's work instead of
delaying the next launch; there greedy decode steps are also launched ahead (ahead.py).
Elsewhere events go out at the end of the step.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..backends import kv_type
from ..models import Model
from ..sampler import NoTokenAllowed, Sampler, SamplerVocab, SamplingParams
from .ahead import DecodeAhead
from .metrics import EngineMetrics, KVUsage
from .output import Output, SeqOutput
from .pages import PagePool
from .radix import RadixCache
from .requests import FinishEvent, GrammarSpec, Request, RequestHandle
from .runner import Launched, ModelRunner
from .scheduler import Plan, Scheduler, SchedulerConfig
from .sequence import Sequence, Status
from .tiers import TierConfig, TieredCache, identity
from .draftmodel import DraftModel
from .speculate import SpecConfig, Speculator

if TYPE_CHECKING:
    import asyncio


class QueueFull(RuntimeError):
    """Too many requests are waiting; try again later."""


class EngineClosed(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    n_ctx: int = 4096  # longest sequence (prompt + generated tokens)
    max_seqs: int = 4  # sequences running at once ("slots")
    kv_tokens: int | None = None  # KV cache capacity in tokens (default n_ctx * max_seqs)
    page_size: int = 16
    max_batch_tokens: int = 512
    max_waiting: int = 1024  # queued sequences beyond which submit raises QueueFull
    prefix_cache: bool = True
    # greedy decode steps launched before the host has read the step before them (ahead.py): None,
    # where the backend takes their tokens from that step's best ids itself (its capabilities say
    # chain_tokens); True, also elsewhere, the host choosing them once the step before has run (the
    # same bookkeeping, for tests); False, never (a benchmark's baseline)
    decode_ahead: bool | None = None
    cache_type_k: str = "f16"  # the KV cache's storage types (backends.KV_TYPES names)
    cache_type_v: str = "f16"
    tiers: TierConfig = TierConfig()  # host-RAM and disk tiers below the pool (tiers.py)
    model_digest: bytes = b""  # the model file's hash: what the disk tier's pages must belong to
    speculative: SpecConfig = SpecConfig()  # draft sources and limits (speculate.py); off by default

    def __post_init__(self):
        kv_type(self.cache_type_k), kv_type(self.cache_type_v)  # ValueError for an unknown name
        for name in ("n_ctx", "max_seqs", "page_size", "max_batch_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.kv_tokens is not None and self.kv_tokens < self.n_ctx:
            raise ValueError(f"the KV cache ({self.kv_tokens} tokens) must hold at least one context ({self.n_ctx})")

    @property
    def n_pages(self) -> int:
        tokens = self.kv_tokens or self.n_ctx * self.max_seqs
        return -(-tokens // self.page_size)


class Engine:
    def __init__(self, model: Model, tokenizer, config: EngineConfig = EngineConfig(),
                 draft_model: Model | None = None):
        """draft_model: the speculative source `draft`'s model (config.speculative.model describes it)."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        caps = model.backend.capabilities
        self.pool = PagePool(config.n_pages, config.page_size)
        # one page past the pool's: the runner's padding tokens write there (see ModelRunner)
        self.cache = model.new_kv_cache(config.n_pages + 1, config.page_size, kv_type(config.cache_type_k),
                                        kv_type(config.cache_type_v))
        self.tree = RadixCache(self.pool)
        self.tiers = self._tiers(config)
        self.scheduler = Scheduler(self.pool, self.tree, SchedulerConfig(
            max_seqs=config.max_seqs, max_batch_tokens=config.max_batch_tokens,
            max_logit_rows=min(model.max_output_rows, 1024), prefix_cache=config.prefix_cache))
        self.runner = ModelRunner(model, self.cache, config.max_batch_tokens, config.max_seqs,
                                  -(-config.n_ctx // config.page_size), pad_page=config.n_pages)
        drafter = self._drafter(draft_model, config, model.n_vocab)
        ahead = caps.chain_tokens if config.decode_ahead is None else config.decode_ahead
        self.spec = Speculator(config.speculative.for_engine(ahead and caps.top_k), self.tree, config.n_ctx, drafter)
        self.output = Output(self.scheduler, tokenizer, EngineMetrics(), config.n_ctx, device_top_k=caps.top_k,
                             speculator=self.spec)
        self.ahead = DecodeAhead(self.scheduler, self.runner, config.n_ctx, enabled=ahead and caps.top_k)
        self.sampler_vocab = SamplerVocab.from_tokenizer(tokenizer)
        self.last_error: str | None = None
        self._grammar_vocab = None  # built on the first grammar request
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._adds_lock = threading.Lock()
        self._adds_in_inbox = 0  # requests in the inbox (their sequences are not yet in scheduler.waiting)
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="ember-engine", daemon=True)
        self._thread.start()

    @property
    def identity(self) -> bytes:
        """What pages saved by this engine must match to be used by another: the model file, the KV layout."""
        c = self.config
        return identity(c.model_digest, c.cache_type_k, c.cache_type_v, c.page_size, self.cache.page_nbytes)

    @staticmethod
    def _drafter(model: Model | None, config: EngineConfig, target_vocab: int) -> DraftModel | None:
        if model is None:
            return None
        spec = config.speculative.model
        n_ctx = min(spec.n_ctx or config.n_ctx, config.n_ctx) if spec is not None else config.n_ctx
        return DraftModel(model, n_ctx, config.max_seqs, config.page_size, config.max_batch_tokens, target_vocab)

    def _tiers(self, config: EngineConfig) -> TieredCache | None:
        if not (config.tiers.enabled and config.prefix_cache):
            return None
        return TieredCache(config.tiers, self.tree, self.pool, self.cache, self.identity)

    @property
    def metrics(self) -> EngineMetrics:
        return self.output.metrics

    @metrics.setter
    def metrics(self, metrics: EngineMetrics) -> None:
        """Count on in another engine's counters (a server's model loaded again after sleeping)."""
        self.output.metrics = metrics

    # ---- submitting ----
    def submit(self, request: Request) -> RequestHandle:
        """Queue a request (thread-safe); iterate the handle for its events."""
        return self._submit(request, None)

    def submit_async(self, request: Request, loop: "asyncio.AbstractEventLoop | None" = None) -> RequestHandle:
        """Like submit, for asyncio: `async for ev in engine.submit_async(req)` in the running loop,
        or from a worker thread with the loop whose tasks will read the events."""
        import asyncio

        return self._submit(request, loop or asyncio.get_running_loop())

    def _submit(self, request: Request, loop) -> RequestHandle:
        if self._closed:
            raise EngineClosed("the engine is shut down")
        self._check_fits(request)
        with self._adds_lock:  # waiting, or sent and not yet seen by the engine (cancel messages do not count)
            if len(self.scheduler.waiting) + self._adds_in_inbox >= self.config.max_waiting:
                raise QueueFull(f"{self.config.max_waiting} requests are already waiting")
            self._adds_in_inbox += 1
        try:
            handle = self._handle(request, loop)
        except BaseException:
            with self._adds_lock:
                self._adds_in_inbox -= 1
            raise
        self._inbox.put(("add", handle))
        self._wake.set()
        return handle

    def _handle(self, request: Request, loop) -> RequestHandle:
        compiled = self._compile(request.grammar)  # GrammarError here, in the caller's thread
        handle = RequestHandle(self._cancel, request.n, loop)
        room = self.config.n_ctx - len(request.prompt)
        for i in range(request.n):
            seq = Sequence(list(request.prompt), min(request.max_tokens, room),
                           prompt_logits=request.prompt_reduce is not None,
                           prompt_logits_from=request.prompt_logits_from, client=request.client)
            matcher = compiled.matcher(request.grammar.lazy_triggers or None) if compiled else None
            sampler = self._sampler(request, i)
            if sampler.n_banned >= self.model.n_vocab:
                raise NoTokenAllowed(f"no token is allowed: logit_bias and ignore_eos ban all {self.model.n_vocab} "
                                     f"tokens of the vocabulary")
            decoder = self.tokenizer.stream_decoder(shown=request.shown_tokens)
            drafting = self.spec.state_for(request.speculative)
            seq.owner = SeqOutput(handle, i, request, sampler, decoder, matcher, drafting)
            handle.seqs.append(seq)
        return handle

    def _check_fits(self, request: Request) -> None:
        n_prompt, n_ctx = len(request.prompt), self.config.n_ctx
        if n_prompt > n_ctx:
            raise ValueError(f"the prompt has {n_prompt} tokens; the context holds {n_ctx}")
        bad = next((t for t in request.prompt if not 0 <= t < self.model.n_vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{self.model.n_vocab - 1})")

    def _compile(self, spec: GrammarSpec | None):
        """The grammar bound to this vocabulary (parses and compilations are cached by text)."""
        if spec is None:
            return None
        from ..gbnf import Grammar, TokenVocab

        if self._grammar_vocab is None:
            self._grammar_vocab = TokenVocab.for_tokenizer(self.tokenizer)
        return Grammar.parse(spec.gbnf, root=spec.root).compile(self._grammar_vocab)

    def _sampler(self, request: Request, index: int) -> Sampler:
        params = request.sampling
        if index and params.seed is not None:  # parallel samples: distinct, reproducible streams
            params = _with_seed(params, params.seed + index)
        sampler = Sampler(params, vocab=self.sampler_vocab, n_ctx=self.config.n_ctx)
        sampler.accept_many(request.prompt)  # penalties see the prompt, as in llama-server
        return sampler

    def _cancel(self, handle: RequestHandle) -> None:
        self._inbox.put(("cancel", handle))
        self._wake.set()

    # ---- the loop ----
    def _loop(self) -> None:
        while not self._closed:
            busy = self.scheduler.has_work or self.ahead.pending
            if not busy:
                self.output.hand_over()  # nothing to overlap with: before waiting for work
            self._drain_inbox(block=not busy)
            if self._closed:
                break
            try:
                self.step()
            except Exception as e:  # a bug must not leave callers hanging
                self._fail_running(f"{type(e).__name__}: {e}", traceback.format_exc())
        self._shutdown()
        self.output.outbox.deliver()

    def _drain_inbox(self, block: bool) -> None:
        if block:
            self._wake.wait()
        self._wake.clear()
        for kind, handle in self._inbox_items():
            if kind == "add":
                for seq in handle.seqs:  # (outside the lock: reading pages back may take a while)
                    self._restore(seq)
                with self._adds_lock:  # moved to waiting in the same breath: the count never dips
                    for seq in handle.seqs:
                        self.scheduler.add(seq)
                        self.metrics.requests_started += 1
                    self._adds_in_inbox -= 1
            elif kind == "cancel":
                for seq in handle.seqs:
                    seq.cancelled = True
            elif kind == "clear":
                self.tree.clear()
                self.spec.clear()
            elif kind == "call":
                _call(*handle)

    def _restore(self, seq: Sequence) -> None:
        """Pages of the prompt's prefix the tiers below the pool hold, back in the pool."""
        if self.tiers is not None and not seq.prompt_logits:
            self.tiers.restore(seq.tokens[:-1])

    def _inbox_items(self):
        """What callers sent since the last look: (kind, handle) pairs (this thread alone takes from the
        inbox: what empty() says is there stays there)."""
        while not self._inbox.empty():
            yield self._inbox.get_nowait()

    def step(self) -> None:
        """Plan, run, post-process: one batched forward pass."""
        self.output.finish_cancelled()
        t0 = time.perf_counter()
        step = self.ahead.take() or self._launch(self._schedule())
        if step is None:  # nothing can run now (waiting on pages): do not spin
            self.output.hand_over()
            self._wake.wait(0.005)
            return
        # a draft needs the token chosen before it: no step launched ahead while some sequence may draft
        if not (self.spec.enabled and self.spec.would_draft(self.scheduler.running)):
            self.metrics.ahead_steps += self.ahead.follow(step, quiet=self._inbox.empty())
        self.output.hand_over()  # the last step's texts and events, while this one runs on the device
        self._postprocess(step, self.runner.wait(step))
        if not step.recorded:  # what drafted rows cost, as steps run (a recording's time is not the step's)
            self.spec.measured(step.plan, time.perf_counter() - t0)

    def _schedule(self) -> Plan:
        """The next step's plan, decoding sequences' drafts in it."""
        if self.spec.enabled:
            self.spec.propose(self.scheduler.running)
        return self.scheduler.schedule()

    def _postprocess(self, step: Launched, results) -> None:
        self.scheduler.complete(step.plan)
        self.output.postprocess(step.plan, results, best_only=bool(step.top_k))
        if not self.runner.overlaps:  # the next step would compute before launching: nothing later
            self.output.hand_over()
        self.metrics.count_step(len(step.plan.chunks), bool(step.top_k))

    def _launch(self, plan: Plan) -> Launched | None:
        if not plan.chunks:
            return None
        self.output.planned(plan)
        return self.runner.launch(plan, self.output.best_needed(plan))

    def _fail_running(self, message: str, trace: str) -> None:
        self.ahead.drop()
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            try:
                self.output.finish(seq, "error", error=message)
            except Exception:  # pragma: no cover - bookkeeping already broken
                seq.status = Status.FINISHED
        self.last_error = trace
        self.output.outbox.deliver()

    # ---- state ----
    def kv_usage(self) -> KVUsage:
        in_use = set()
        for seq in self.scheduler.running:
            in_use.update(seq.pages)
        free = self.pool.n_free
        return KVUsage(self.pool.n_pages, free, len(in_use), self.pool.n_pages - free - len(in_use),
                       self.pool.page_size, self.tree.n_tokens)

    def call(self, fn) -> Future:
        """Run fn() on the engine's thread between steps (it may use the pool, the tree, the cache);
        the future has its result."""
        future: Future = Future()
        self._inbox.put(("call", (fn, future)))
        self._wake.set()
        return future

    def clear_cache(self) -> None:
        """Drop every cached prefix not in use (at the next step)."""
        self._inbox.put(("clear", None))
        self._wake.set()

    def close(self) -> None:
        """Cancel everything and stop the loop thread."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)
        if self.tiers is not None and not self._thread.is_alive():
            self.tiers.persist()  # what the pool and host memory hold outlives the process

    def _shutdown(self) -> None:
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.output.finish(seq, "cancelled")
        for kind, handle in self._inbox_items():
            if kind == "add":  # never admitted: tell the caller it ended
                for seq in handle.seqs:
                    st = seq.owner
                    # handed over with the rest by the deliver after this
                    self.output.outbox.put(st.handle, FinishEvent(st.index, "cancelled", "", seq.n_prompt, 0, 0))
            elif kind == "call":
                handle[1].set_exception(EngineClosed("the engine is shut down"))


def _call(fn, future: Future) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except Exception as e:
        future.set_exception(e)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return replace(params, seed=seed % (1 << 32))
