"""The engine: one loop thread owns the model and runs steps for every request at once.

Callers submit requests from any thread (`submit`) or from asyncio (`submit_async`);
each request's tokens stream back through its handle; a handle can be cancelled at
any time and its sequence leaves within one step. A step is: schedule, run, postprocess.

On a device that runs a step while the host goes on (a GPU), the events (tokens, finishes) a
step produces wait in an outbox and are handed to their callers once the next step is launched:
waking a caller's thread (and that thread taking the interpreter lock) then overlaps the
device's work instead of delaying the next launch. Elsewhere they go out at the end of the step.
"""
from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..models import Model
from ..sampler import NoTokenAllowed, NonFiniteLogits, Sampler, SamplerVocab, SamplingError, SamplingParams
from .metrics import EngineMetrics, KVUsage
from .pages import PagePool
from .radix import RadixCache
from .runner import Ahead, ModelRunner
from .scheduler import Plan, Scheduler, SchedulerConfig
from .sequence import Sequence, Status
from .stops import StopMatcher

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
    # greedy decode steps launched before the host has read the step before them (see
    # Engine._launch_ahead): None, where the device takes their tokens from that step's best ids
    # itself (CUDA; EMBER_DECODE_AHEAD=0 turns it off); True, also elsewhere, the host choosing
    # them once the step before has run (the same bookkeeping, for tests); False, never
    decode_ahead: bool | None = None

    def __post_init__(self):
        for name in ("n_ctx", "max_seqs", "page_size", "max_batch_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.kv_tokens is not None and self.kv_tokens < self.n_ctx:
            raise ValueError(f"the KV cache ({self.kv_tokens} tokens) must hold at least one context ({self.n_ctx})")

    @property
    def n_pages(self) -> int:
        tokens = self.kv_tokens or self.n_ctx * self.max_seqs
        return -(-tokens // self.page_size)


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """Constrain the output to a GBNF grammar; with triggers, only from the first trigger on
    (a token id, or text such as "<tool_call>"), as llama.cpp's lazy grammars do."""

    gbnf: str
    root: str = "root"
    lazy_triggers: tuple[str | int, ...] = ()


@dataclass(slots=True)
class Request:
    prompt: list[int]
    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # stop strings (not included in the output; empty ones are ignored)
    n: int = 1  # parallel samples sharing the prompt
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token's plus top k
    prompt_reduce: Callable[[np.ndarray, np.ndarray], Any] | None = None  # scoring: called on prompt logits
    prompt_logits_from: int = 0  # first prompt position whose logits prompt_reduce sees
    grammar: GrammarSpec | None = None
    client: str = ""  # who sends it: the engine admits waiting requests taking turns between clients

    def __post_init__(self):
        if not self.prompt:
            raise ValueError("the prompt is empty")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")


@dataclass(slots=True)
class TokenEvent:
    index: int  # which of the request's n samples
    token: int
    text: str  # new text (held back while it could be the start of a stop string)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class PromptEvent:
    """Result of the request's prompt_reduce on one piece of prompt logits."""

    index: int
    value: Any


@dataclass(slots=True)
class FinishEvent:
    index: int
    reason: str  # "stop", "length", "cancelled" or "error"
    text: str  # last held-back text
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    error: str | None = None
    # with reason "error": "no_token_allowed" (the request's grammar, logit_bias and ignore_eos left no
    # token), "non_finite_logits" (the model produced NaN/inf), None (anything else)
    code: str | None = None


class RequestHandle:
    """Stream of one request's events; iterate (threads) or `async for` (asyncio)."""

    def __init__(self, engine: "Engine", n: int, loop: "asyncio.AbstractEventLoop | None"):
        self._engine, self._n_open = engine, n
        self.seqs: list[Sequence] = []
        self.submitted = time.perf_counter()
        self._loop = loop
        if loop is None:
            self._sync: queue.SimpleQueue | None = queue.SimpleQueue()
        else:
            self._sync = None
            import asyncio  # only asyncio callers get here, and they have it loaded

            self._aqueue: asyncio.Queue = asyncio.Queue()

    def cancel(self) -> None:
        self._engine._cancel(self)

    def __iter__(self):
        if self._sync is None:
            raise TypeError("this request was submitted from asyncio: use `async for`")
        while self._n_open:
            ev = self._sync.get()
            if isinstance(ev, FinishEvent):
                self._n_open -= 1
            yield ev

    async def __aiter__(self):
        while self._n_open:
            ev = await self._aqueue.get()
            if isinstance(ev, FinishEvent):
                self._n_open -= 1
            yield ev


def _put_all(items) -> None:
    """In an event loop: each (asyncio queue, event) pair, in order."""
    for q, ev in items:
        q.put_nowait(ev)


def _call_in_loop(loop, fn, arg) -> None:
    """fn(arg) in the loop's thread; nothing where the loop is closed (its caller is gone)."""
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:
        pass


MAX_DEVICE_BEST = 64  # most best-token candidates per row brought back instead of the whole row


class _SeqState:
    """What the engine keeps per sequence besides scheduling: sampling and text."""

    __slots__ = ("handle", "index", "request", "sampler", "decoder", "stops", "last_token_at", "first_token_at",
                 "counted", "matcher")

    def __init__(self, handle: RequestHandle, index: int, request: Request, sampler: Sampler, decoder, matcher):
        self.handle, self.index, self.request = handle, index, request
        self.sampler, self.decoder, self.matcher = sampler, decoder, matcher
        # the stop strings' search; it holds back text that may be the start of one
        self.stops = StopMatcher(request.stop) if request.stop else None
        self.last_token_at = 0.0
        self.first_token_at = 0.0
        self.counted = False  # prompt statistics recorded


class Engine:
    def __init__(self, model: Model, tokenizer, config: EngineConfig = EngineConfig()):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.pool = PagePool(config.n_pages, config.page_size)
        # one page past the pool's: the runner's padding tokens write there (see ModelRunner)
        self.cache = model.new_kv_cache(config.n_pages + 1, config.page_size)
        self.tree = RadixCache(self.pool)
        self.scheduler = Scheduler(self.pool, self.tree, SchedulerConfig(
            max_seqs=config.max_seqs, max_batch_tokens=config.max_batch_tokens,
            max_logit_rows=min(model.max_output_rows, 1024), prefix_cache=config.prefix_cache))
        self.runner = ModelRunner(model, self.cache, config.max_batch_tokens, config.max_seqs,
                                  -(-config.n_ctx // config.page_size), pad_page=config.n_pages)
        self.sampler_vocab = SamplerVocab.from_tokenizer(tokenizer)
        self.metrics = EngineMetrics()
        self.last_error: str | None = None
        self._grammar_vocab = None  # built on the first grammar request
        self._device_top_k = hasattr(model.backend, "top_k")  # greedy steps need only token ids
        self._mask: np.ndarray | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._adds_lock = threading.Lock()
        self._adds_in_inbox = 0  # requests in the inbox (their sequences are not yet in scheduler.waiting)
        self._wake = threading.Event()
        self._outbox: list = []  # (handle, event) not yet handed to callers, in order (see _deliver)
        # tokens chosen and appended whose text and event are still to make (_emit_pending): made
        # while the next step runs on a device that overlaps, one per sequence at most
        self._later: dict = {}
        ahead = config.decode_ahead
        if ahead is None:
            ahead = self.runner.chains and os.environ.get("EMBER_DECODE_AHEAD", "1") != "0"
        self._ahead_ok = bool(ahead) and self._device_top_k
        # (plan, top_k, results, mark): a step launched before the last one's results were read
        self._ahead: tuple | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="ember-engine", daemon=True)
        self._thread.start()

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
        handle = RequestHandle(self, request.n, loop)
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
            seq.owner = _SeqState(handle, i, request, sampler, self.tokenizer.stream_decoder(), matcher)
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
            busy = self.scheduler.has_work or self._ahead is not None
            if not busy:
                self._emit_pending()
                self._deliver()  # nothing to overlap with: before waiting for work
            self._drain_inbox(block=not busy)
            if self._closed:
                break
            try:
                self.step()
            except Exception as e:  # a bug must not leave callers hanging
                self._fail_running(f"{type(e).__name__}: {e}", traceback.format_exc())
        self._shutdown()
        self._deliver()

    def _deliver(self) -> None:
        """Hand the outbox's events to their callers: to a thread's queue each, and to asyncio
        callers as one call per event loop for all of them (one wake-up of the loop a step, not
        one per token: at 64 streams a step's events cost the engine's thread 64 of those)."""
        out, self._outbox = self._outbox, []
        by_loop: dict = {}
        for handle, event in out:
            if handle._loop is None:
                handle._sync.put(event)
            else:
                by_loop.setdefault(handle._loop, []).append((handle._aqueue, event))
        for loop, items in by_loop.items():
            _call_in_loop(loop, _put_all, items)

    def _drain_inbox(self, block: bool) -> None:
        if block:
            self._wake.wait()
        self._wake.clear()
        for kind, handle in self._inbox_items():
            if kind == "add":
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

    def _inbox_items(self):
        """What callers sent since the last look: (kind, handle) pairs."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def step(self) -> None:
        """Schedule, run, postprocess: one batched forward pass."""
        self._finish_cancelled()
        if self._ahead is not None:  # launched by the last call, before it read its own step
            (plan, top_k, out, mark), self._ahead = self._ahead, None
        else:
            plan = self.scheduler.schedule()
            if not plan.chunks:
                self._emit_pending()
                self._deliver()
                self._wake.wait(0.005)  # nothing can run now (waiting on pages): do not spin
                return
            self._count_admissions(plan)
            top_k = self._best_needed(plan)
            out = self.runner.run(plan, top_k, wait=False)
            mark = self.runner.mark()
        if self._ahead_ok and top_k:
            self._ahead, out = self._launch_ahead(plan, top_k, out)
        self._emit_pending()  # the last step's texts and events, while this one runs on the device
        self._deliver()
        self.runner.wait(mark)
        self.scheduler.complete(plan)
        self._postprocess(plan, out, best_only=bool(top_k))
        if not self.runner.overlaps:  # the next step would compute before launching: no later
            self._emit_pending()
            self._deliver()
        self.metrics.steps += 1
        self.metrics.sequence_steps += len(plan.chunks)
        self.metrics.argmax_steps += bool(top_k)

    def _launch_ahead(self, plan: Plan, top_k: int, out) -> tuple:
        """The next step launched now, before this one's results are read: where every running
        sequence decodes in this step and keeps decoding after it whatever token it gets, nothing
        waits for admission and no request or cancellation is in the inbox, the next step is each
        sequence one position on, its token the greedy choice from its best ids of this step (on the
        device where it chains them). The host's work on this step's results (choosing, appending,
        texts, events, the next schedule) then overlaps the device's on the next. A sequence this
        step ends after all (an end-of-generation token, a stop string, a cancellation) has its
        row of the next step dropped; its cache slot there lies past what it computed. Returns
        ((plan, top_k, results, mark) or None, this step's results: copied first where the
        next step's run would overwrite them)."""
        if self.scheduler.waiting or not self._inbox.empty() or plan.copies:
            return None, out
        chunks, rows, bans, ending = [], [], [], 0
        for i, c in enumerate(plan.chunks):
            seq = c.seq
            if seq.status is not Status.RUNNING:
                continue  # ended by the step before this one (itself ahead)
            if c.n != 1 or c.logit_rows != [c.start] or len(seq.tokens) != c.start + 1 or seq.prompt_logits:
                return None, out
            if seq.max_new_tokens <= c.start + 2 - seq.n_prompt or c.start + 2 >= self.config.n_ctx:
                ending += 1  # this step's token is its last (length): nothing to compute after it
                continue
            chunks.append(c)
            rows.append(i)
            bans.append(sorted(seq.owner.sampler.banned))
        if not chunks or len(chunks) + ending != len(self.scheduler.running):
            return None, out
        nxt = self.scheduler.plan_ahead(chunks)
        if nxt is None:
            return None, out
        if not self.runner.chains:  # this step has run (the host chooses from it): its buffers may be reused
            out = type(out)(out.ids.copy(), out.values.copy())
        ahead = Ahead(top_k, rows, bans, None if self.runner.chains else out)
        res = self.runner.run(nxt, top_k, wait=False, ahead=ahead)
        self.metrics.ahead_steps += 1
        return (nxt, top_k, res, self.runner.mark()), out

    def _best_needed(self, plan: Plan) -> int:
        """k > 0 when every sequence of the step needs only its rows' k best tokens (greedy, no
        grammar, no logit changes but bans, no log-probabilities) and the backend can find them on
        the device: then only token ids cross to the host instead of rows of vocabulary size."""
        if not self._device_top_k:
            return 0
        k = 1
        for c in plan.chunks:
            st = c.seq.owner
            if c.seq.prompt_logits:
                return 0
            if c.logit_rows:
                need = st.sampler.best_needed if st.matcher is None and st.request.logprobs is None else 0
                if not 0 < need <= MAX_DEVICE_BEST:
                    return 0
                k = max(k, need)
        return k

    def _finish_cancelled(self) -> None:
        for seq in [s for s in self.scheduler.running + self.scheduler.waiting if s.cancelled]:
            self.metrics.requests_cancelled += 1  # before the sequence is seen to leave
            self._finish(seq, "cancelled")

    def _count_admissions(self, plan: Plan) -> None:
        m = self.metrics
        for c in plan.chunks:
            seq = c.seq
            if c.start < seq.n_prompt:
                m.prompt_tokens_computed += min(c.n, seq.n_prompt - c.start)
            if not seq.owner.counted:  # first admission: how much of the prompt the cache served
                seq.owner.counted = True
                m.prompt_tokens += seq.n_prompt
                m.prompt_tokens_cached += seq.n_cache_hit
        m.preemptions = self.scheduler.n_preemptions

    def _postprocess(self, plan: Plan, logits, best_only: bool = False) -> None:
        """best_only: `logits` holds each row's best token ids and their logits (TopLogits, (n_rows,
        k) each, best first) instead of its logits."""
        row = 0
        if best_only:  # ids as Python ints, in one call; whether each row's best logit is finite
            best, usable = logits.ids.tolist(), np.isfinite(logits.values[:, 0]).tolist()
        for chunk in plan.chunks:
            seq = chunk.seq
            n_rows = len(chunk.logit_rows)
            row += n_rows
            if seq.status is Status.FINISHED:  # ended after this step (ahead) was launched: its row is dropped
                continue
            if seq.prompt_logits and chunk.start < seq.n_prompt:
                self._deliver_prompt(seq, chunk, logits[row - n_rows:row])
            if seq.n_computed == len(seq.tokens):  # the last token was computed: its logits are in row - 1
                if not seq.wants_sample:
                    self._finish(seq, "length")
                elif not n_rows:
                    raise AssertionError("a sequence to sample from has no row of logits in its step")
                elif best_only:
                    self._choose_best(seq, best[row - 1], usable[row - 1])
                else:
                    self._sample(seq, logits[row - 1])

    def _deliver_prompt(self, seq: Sequence, chunk, rows: np.ndarray) -> None:
        st = seq.owner
        positions = np.asarray(chunk.logit_rows, np.int64)
        keep = positions < seq.n_prompt
        if not keep.any():
            return
        event = PromptEvent(st.index, st.request.prompt_reduce(rows[keep], positions[keep]))
        self._outbox.append((st.handle, event))

    def _choose_best(self, seq: Sequence, ids: list[int], usable: bool) -> None:
        """The greedy choice from a row's best ids: none where the row had no finite best logit, or
        fewer comparable logits than banned ids before them (NaN logits come back as id -1)."""
        try:
            token = seq.owner.sampler.choose_from_best(ids) if usable else -1
        except SamplingError as e:
            self._fail_sampling(seq, e)
            return
        if token < 0:
            self._fail_sampling(seq, NonFiniteLogits("the model produced non-finite logits (NaN/inf)"))
            return
        self._emit(seq, token, None, later=True)

    def _fail_sampling(self, seq: Sequence, e: SamplingError) -> None:
        """This sequence ends with the error; the others go on."""
        self._finish(seq, "error", error=str(e), code=e.code)

    def _sample(self, seq: Sequence, row: np.ndarray) -> None:
        st, req = seq.owner, seq.owner.request
        try:
            token = st.sampler.sample(row, self._allowed(st))
        except SamplingError as e:
            self._fail_sampling(seq, e)
            return
        if st.matcher is not None and not st.matcher.accept_token(token):
            self._finish(seq, "error", error=f"the grammar rejected token {token} it had allowed")
            return
        lp = st.sampler.logprobs(token, n=req.logprobs) if req.logprobs is not None else None
        if not self._emit(seq, token, lp) or st.matcher is None or req.logprobs is not None:
            return
        # Tokens the grammar leaves no choice about are appended now, without sampling, and computed
        # together in the next step (no log-probabilities for them: requests that want those skip this).
        for forced in st.matcher.forced_tokens(limit=min(64, seq.max_new_tokens - seq.n_generated)):
            if not st.matcher.accept_token(forced) or not self._emit(seq, forced, None):
                return
            self.metrics.forced_tokens += 1

    def _emit(self, seq: Sequence, token: int, lp, later: bool = False) -> bool:
        """Append a chosen token and send it; False when the sequence finished with it. later: the
        token's text and event may be made after the next step is launched (_emit_pending), where
        nothing about them can end the sequence (no stop strings, no log-probabilities)."""
        st, req = seq.owner, seq.owner.request
        st.sampler.accept(token)
        self._time_token(seq, time.perf_counter())
        if token in self.tokenizer.eog_ids:
            self._finish(seq, "stop")
            return False
        seq.tokens.append(token)
        self.metrics.generated_tokens += 1
        at_length = not seq.wants_sample or len(seq.tokens) >= self.config.n_ctx
        if later and not req.stop and lp is None and not at_length:
            self._later[seq] = token
            return True
        self._event(seq, token, lp)
        if seq.status is Status.FINISHED:
            return False
        if at_length:
            self._finish(seq, "length")
            return False
        return True

    def _emit_pending(self) -> None:
        """The texts and events of tokens _emit left for later, in the order they were chosen."""
        later, self._later = self._later, {}
        for seq, token in later.items():
            self._event(seq, token, None)

    def _event(self, seq: Sequence, token: int, lp) -> None:
        """A chosen token's text and event; a stop string in the text ends the sequence."""
        st, req = seq.owner, seq.owner.request
        piece = st.decoder.feed(token)
        text, stopped = st.stops.feed(piece) if st.stops is not None else (piece, False)
        self._outbox.append((st.handle, TokenEvent(st.index, token, text, lp.logprob if lp else None,
                                                         list(zip(lp.top_ids, lp.top_logprobs)) if lp and req.logprobs
                                                         else None)))
        if stopped:
            self._finish(seq, "stop", flush=False)  # whatever follows the stop string is dropped

    def _allowed(self, st: _SeqState) -> np.ndarray | None:
        """The grammar's mask of allowed tokens (packed bits), or None without a grammar."""
        if st.matcher is None:
            return None
        if self._mask is None:
            self._mask = np.empty(self._grammar_vocab.n_words, np.uint32)
        st.matcher.fill_mask(self._mask)
        return self._mask

    def _time_token(self, seq: Sequence, now: float) -> None:
        st, m = seq.owner, self.metrics
        if st.first_token_at == 0.0:
            st.first_token_at = now
            ttft = now - st.handle.submitted
            (m.ttft_hit if 2 * seq.n_cache_hit >= seq.n_prompt else m.ttft_miss).observe(ttft)
        else:
            m.inter_token.observe(now - st.last_token_at)
        st.last_token_at = now

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, flush: bool = True,
                code: str | None = None) -> None:
        """End a sequence; `flush` sends the text still held back (incomplete UTF-8, stop-string candidates)."""
        if seq.status is Status.FINISHED:
            return
        token = self._later.pop(seq, None)
        if token is not None:  # its last token's text and event come first
            self._event(seq, token, None)
            if seq.status is Status.FINISHED:
                return
        self.metrics.requests_finished += 1  # counted before anyone can see the sequence gone
        self.scheduler.finish(seq, reason)
        st = seq.owner
        tail = ((st.stops.flush() if st.stops is not None else "") + st.decoder.flush()) if flush else ""
        self._outbox.append((st.handle, FinishEvent(st.index, reason, tail, seq.n_prompt, seq.n_cache_hit,
                                                          seq.n_generated, error, code)))

    def _fail_running(self, message: str, trace: str) -> None:
        self._ahead = None
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            try:
                self._finish(seq, "error", error=message)
            except Exception:  # pragma: no cover - bookkeeping already broken
                seq.status = Status.FINISHED
        self.last_error = trace
        self._deliver()

    # ---- state ----
    def kv_usage(self) -> KVUsage:
        in_use = set()
        for seq in self.scheduler.running:
            in_use.update(seq.pages)
        free = self.pool.n_free
        return KVUsage(self.pool.n_pages, free, len(in_use), self.pool.n_pages - free - len(in_use),
                       self.pool.page_size, self.tree.n_tokens)

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

    def _shutdown(self) -> None:
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish(seq, "cancelled")
        for kind, handle in self._inbox_items():
            if kind == "add":  # never admitted: tell the caller it ended
                for seq in handle.seqs:
                    st = seq.owner
                    # handed over with the rest by the _deliver after this
                    self._outbox.append((st.handle, FinishEvent(st.index, "cancelled", "", seq.n_prompt, 0, 0)))


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed % (1 << 32))
