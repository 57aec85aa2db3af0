"""The core's run: a `Generation` made ready for the engine (prompt ids, the grammar, a reader
per sample), submitted (engine refusals -> HTTP errors), and followed while it runs.

`start` returns a `Run`. Iterating it gives a `Step` per engine event: the token (or the end) of
one sample, with what it adds to the reply; `collect` runs it to the end instead and gives the
finished `Sample`s, each with its whole reply. Building the prompt and submitting run off the
event loop (`off_loop`): rendering, tokenizing and compiling a grammar of a big request take long
enough to stall every other client.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool as off_loop
from starlette.requests import Request as HTTPRequest

from ...engine import EngineClosed, FinishEvent, ProgressEvent, QueueFull, Request, RequestHandle, TokenEvent
from ...engine.budget import ThinkingBudget
from ...engine.engine import GrammarSpec
from ...gbnf import GrammarError
from ...sampler import NoTokenAllowed
from ..errors import APIError, invalid, not_ready, queue_full, server_error
from ..state import ServerModel, ServerState
from .formats import Reading
from .prompts import chat_format, chat_prompt, prompt_ids, shown_tokens
from .replies import Delta, Output, PlainOutput, Reply
from .request import Chat, Generation
from .tools import protocol_for


@dataclass(slots=True)
class Prepared:
    """A Generation made ready for the engine."""

    prompts: list[list[int]]  # token ids, one list per prompt
    grammar: GrammarSpec | None
    grammar_param: str | None  # the field the grammar came from (for errors)
    prefill: str = ""  # the final assistant message the reply continues
    reading: Reading | None = None  # how a chat's replies are read (None: completions, plain text)
    shown_tokens: frozenset[int] = frozenset()  # the chat format's marker tokens, written as text
    budget: ThinkingBudget | None = None  # the reasoning's cap (reasoning_budget)


def prepare(model: ServerModel, gen: Generation) -> Prepared:
    """The prompts' ids and the grammar: the tools' own where tools are active (the protocol
    is the model's), else the request's; 400 for a prompt that cannot run."""
    if not isinstance(gen.prompt, Chat):
        constraint = gen.constraint
        return Prepared(prompt_ids(model, gen.prompt), constraint and constraint.grammar, constraint and constraint.param)
    fmt = chat_format(model)
    prompt = chat_prompt(model, gen.prompt)
    tools = protocol_for(fmt).grammar(gen.prompt.tools, prompt.thinking)
    grammar, param = (tools, "tools") if tools is not None else \
        (gen.constraint.grammar, gen.constraint.param) if gen.constraint else (None, None)
    reading = Reading(gen.prompt.tools.active, prompt.thinking, gen.prompt.reasoning_format != "none")
    return Prepared([prompt.ids], grammar, param, prompt.prefill, reading, shown_tokens(model, fmt),
                    thinking_budget(model, fmt, gen.prompt, prompt.thinking))


def thinking_budget(model: ServerModel, fmt, chat: Chat, opened: bool) -> ThinkingBudget | None:
    """The cap reasoning_budget puts on the reasoning, in the format's markers (None: no cap, or
    a format without reasoning)."""
    markers = fmt.thinking_markers()
    if chat.reasoning_budget < 0 or markers is None:
        return None
    start, end, close = markers
    ids = model.tokenizer.encode(close, add_special=False, parse_special=True)
    return ThinkingBudget(chat.reasoning_budget, tuple(ids), "" if opened else start, end)


async def start(state: ServerState, model: ServerModel, gen: Generation, http: HTTPRequest | None = None) -> Run:
    """Prepare `gen` and submit one engine request per prompt from the client `http` names (off
    the loop); engine refusals become HTTP errors."""
    if model.engine is None:
        raise APIError(501, "This server does not support completions. Start it without --embeddings",
                       type="not_supported_error", code="not_supported")
    client = client_key(state, http) if http is not None else ""
    prepared, handles, refused = await off_loop(_launch, model, gen, client, asyncio.get_running_loop())
    if refused is not None:
        raise _submit_error(state, refused, prepared.grammar_param) from None
    if state.draining:  # began while the requests were prepared
        for h in handles:
            h.cancel()
        raise not_ready("the server is shutting down")
    state.stats.requests += 1
    readers = [reader(model, gen, prepared) for _ in range(len(handles) * gen.n)]
    return Run(state, handles, gen.n, prepared, readers)


def reader(model: ServerModel, gen: Generation, prepared: Prepared) -> Output:
    """What reads one sample's text: the chat format's reader, or plain text for completions."""
    if prepared.reading is None:
        return PlainOutput()
    return protocol_for(chat_format(model)).output(gen.prompt.tools, prepared.reading)


def _launch(model: ServerModel, gen: Generation, client: str, loop):
    """(prepared, handles, None), or (prepared, [], what the engine refused with); an APIError
    for a prompt that cannot run."""
    prepared = prepare(model, gen)
    try:
        return prepared, _submit(model, prepared, gen, client, loop), None
    except Exception as e:
        return prepared, [], e


def _submit(model: ServerModel, prepared: Prepared, gen: Generation, client: str, loop) -> list[RequestHandle]:
    handles: list[RequestHandle] = []
    try:
        for ids in prepared.prompts:
            handles.append(model.engine.submit_async(Request(
                ids, gen.max_tokens, gen.sampling, gen.stop, gen.n, gen.logprobs, grammar=prepared.grammar,
                client=client, progress=gen.progress, shown_tokens=prepared.shown_tokens,
                thinking_budget=prepared.budget, speculative=gen.speculative), loop))
    except BaseException:
        for h in handles:
            h.cancel()
        raise
    return handles


def client_key(state: ServerState, http: HTTPRequest) -> str:
    """Whom the engine's queue takes turns between: the API key where the server requires one (a
    digest: keys stay out of the engine), else the remote address (a key the server does not ask
    for would let a client pose as many)."""
    if state.config.api_keys:
        given = http.headers.get("x-api-key") or http.headers.get("authorization", "").partition(" ")[2].strip()
        return "key:" + hashlib.sha256(given.encode()).hexdigest()[:16]
    return "addr:" + (http.client.host if http.client else "")


def _submit_error(state: ServerState, e: BaseException, grammar_param: str | None) -> BaseException:
    if isinstance(e, QueueFull):
        state.stats.rejected_queue_full += 1
        return queue_full(f"the server is busy ({e}); retry later")
    if isinstance(e, EngineClosed):
        return not_ready("the server is shutting down")
    if isinstance(e, GrammarError):
        return invalid(grammar_param or "grammar", f"invalid grammar: {e}", "invalid_grammar")
    if isinstance(e, NoTokenAllowed):
        return invalid("logit_bias", str(e), e.code)
    if isinstance(e, ValueError):
        code = "context_length_exceeded" if "context holds" in str(e) else "invalid_value"
        return invalid(None, str(e), code)
    return e


@dataclass(slots=True)
class Sample:
    """One finished (or finishing) sample: its text, tokens, how it ended and what it says."""

    index: int
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenEvent] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    error_code: str | None = None
    first_at: float = 0.0
    last_at: float = 0.0
    reply: Reply | None = None  # the whole reply (content and tool calls), once finished
    draft_n: int = 0  # tokens drafted (speculative decoding)...
    draft_n_accepted: int = 0  # ...of which kept

    def add(self, ev: TokenEvent, now: float, keep_logprobs: bool) -> None:
        self.text += ev.text
        self.tokens.append(ev.token)
        if keep_logprobs:
            self.logprobs.append(ev)
        self.first_at = self.first_at or now
        self.last_at = now

    def finish(self, ev: FinishEvent) -> None:
        self.text += ev.text
        self.finish_reason, self.error, self.error_code = ev.reason, ev.error, ev.code
        self.prompt_tokens, self.cached_tokens = ev.prompt_tokens, ev.cached_tokens
        self.draft_n, self.draft_n_accepted = ev.draft_n, ev.draft_n_accepted


@dataclass(slots=True)
class Step:
    """One engine event of a running sample, and what it adds to the reply."""

    index: int  # the sample (choice)
    event: TokenEvent | ProgressEvent | FinishEvent
    sample: Sample
    deltas: list[Delta]  # the reply's new content and tool-call pieces
    error: APIError | None = None  # the sample failed: a stream ends with this error

    @property
    def is_token(self) -> bool:
        return isinstance(self.event, TokenEvent)

    @property
    def is_progress(self) -> bool:
        return isinstance(self.event, ProgressEvent)


class Run:
    """The engine requests of one HTTP request while they run. Iterate for `Step`s; leaving early
    (an exception, a disconnect, a closed stream) cancels them. `opening` holds each sample's
    deltas before its first token (the message it continues)."""

    def __init__(self, state: ServerState, handles: list[RequestHandle], n: int, prepared: Prepared,
                 readers: list[Output]):
        self.state, self.handles, self.n = state, handles, n
        self.prompts = [p for p in prepared.prompts for _ in range(n)]  # per choice index
        self.submitted = time.perf_counter()
        self.samples = [Sample(i) for i in range(len(handles) * n)]
        self.readers = readers
        self.opening = [r.feed(prepared.prefill) for r in readers]
        self._iters = [h.__aiter__() for h in handles]
        self._next: dict[int, asyncio.Future] = {}
        self._open = set(range(len(handles)))
        state.active.update(handles)

    def cached_tokens(self, index: int) -> int:
        """Prompt tokens of choice `index` found in the prefix cache (known once it is admitted)."""
        return self.handles[index // self.n].seqs[index % self.n].n_cache_hit

    def __aiter__(self):
        return self

    async def __anext__(self) -> Step:
        got = await self._advance()
        if got is None:
            raise StopAsyncIteration
        return self._step(*got)

    async def _advance(self) -> tuple[int, TokenEvent | ProgressEvent | FinishEvent] | None:
        """The next (choice index, event), recorded in its sample; None once all ended."""
        while self._open:
            k, ev = await self._next_event()
            if ev is None:
                self._open.discard(k)
                continue
            if isinstance(ev, (TokenEvent, FinishEvent)):
                index = k * self.n + ev.index
                self._record(index, ev)
                return index, ev
            if isinstance(ev, ProgressEvent):
                return k * self.n + ev.index, ev
        self.close()
        return None

    def _step(self, index: int, ev: TokenEvent | ProgressEvent | FinishEvent) -> Step:
        sample, reader = self.samples[index], self.readers[index]
        if isinstance(ev, ProgressEvent):
            return Step(index, ev, sample, [])
        if isinstance(ev, TokenEvent):
            return Step(index, ev, sample, reader.feed(ev.text))
        if ev.reason in ("error", "cancelled"):
            return Step(index, ev, sample, [], stream_error(ev))
        deltas, sample.reply = reader.finish(ev.text)
        return Step(index, ev, sample, deltas)

    async def _next_event(self):
        if len(self._iters) == 1:  # the usual case: no merging needed
            try:
                return 0, await self._iters[0].__anext__()
            except StopAsyncIteration:
                return 0, None
        for k in self._open - self._next.keys():
            self._next[k] = asyncio.ensure_future(self._iters[k].__anext__())
        done, _ = await asyncio.wait(self._next.values(), return_when=asyncio.FIRST_COMPLETED)
        k = min(k for k, f in self._next.items() if f in done)
        fut = self._next.pop(k)
        try:
            return k, fut.result()
        except StopAsyncIteration:
            return k, None

    def _record(self, index: int, ev) -> None:
        sample, now = self.samples[index], time.perf_counter()
        if isinstance(ev, TokenEvent):
            if not sample.tokens:  # admitted: the prompt's figures, for timings while it streams
                sample.prompt_tokens, sample.cached_tokens = len(self.prompts[index]), self.cached_tokens(index)
            sample.add(ev, now, ev.logprob is not None)
            return
        sample.finish(ev)
        stats = self.state.stats
        stats.n_tokens_max = max(stats.n_tokens_max, sample.prompt_tokens + len(sample.tokens))
        if sample.first_at:
            self.state.stats.prompt_seconds += sample.first_at - self.submitted
            self.state.stats.predicted_seconds += sample.last_at - sample.first_at

    def close(self) -> None:
        """Cancel whatever still runs and stop tracking (idempotent)."""
        for fut in self._next.values():
            fut.cancel()
        self._next.clear()
        for h in self.handles:
            if self._open:
                h.cancel()
            self.state.active.discard(h)
        self._open.clear()
        self.state.last_used = time.monotonic()

    async def collect(self) -> list[Sample]:
        """Run to the end; the samples in choice order, each with its reply (read once, from the
        whole text). Engine failures become HTTP errors."""
        try:
            while await self._advance() is not None:
                pass
        finally:
            self.close()
        for s in self.samples:
            if s.finish_reason == "error":
                raise generation_error(s.error, s.error_code)
            if s.finish_reason == "cancelled":
                raise not_ready("the request was cancelled: the server is shutting down")
        for s, reader in zip(self.samples, self.readers):
            _, s.reply = reader.finish(s.text)
        return self.samples


def stream_error(ev: FinishEvent) -> APIError:
    """What a stream that has begun ends with when its sample fails."""
    if ev.reason == "cancelled":
        return APIError(503, "the request was cancelled: the server is shutting down", type="unavailable_error",
                        code="cancelled")
    return generation_error(ev.error, ev.code)


def generation_error(message: str | None, code: str | None) -> APIError:
    """What a sequence that ended in error tells its client: 400 where the request left no token to
    choose; 500 where the model produced non-finite logits (a fault of the served model, not of the
    request: no retry or change of request helps) or anything else went wrong."""
    if code == "no_token_allowed":  # the grammar, logit_bias and ignore_eos together: no one field to name
        return invalid(None, message or "no token is allowed", code)
    if code == "non_finite_logits":
        return APIError(500, f"{message}: the model file's weights or the computation are broken",
                        type="server_error", code=code)
    return server_error(f"generation failed: {message}")
