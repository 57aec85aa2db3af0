"""What callers hand the engine and what comes back: a request, the events it produces, the handle
that streams them, and the outbox that hands events over to the callers' threads and event loops."""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..sampler import SamplingParams
from .budget import ThinkingBudget
from .speculate import DraftParams

if TYPE_CHECKING:
    import asyncio

    from .sequence import Sequence


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
    progress: bool = False  # a ProgressEvent when the prompt starts and after each step that computes part of it
    shown_tokens: frozenset[int] = frozenset()  # control tokens the output writes as text (a chat format's markers)
    thinking_budget: ThinkingBudget | None = None  # a cap on the reasoning's tokens
    speculative: DraftParams | None = None  # drafting limits (None: the engine's; n_max 0: no drafts)

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
class ProgressEvent:
    """How far the prompt is computed (for requests with progress): llama-server's prompt_progress."""

    index: int
    total: int  # prompt tokens
    cached: int  # of which the prefix cache held
    processed: int  # prompt tokens in the cache now, the cached ones included
    seconds: float  # since the prompt's first step was planned


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
    draft_n: int = 0  # tokens drafted for this sample (speculative decoding)...
    draft_n_accepted: int = 0  # ...of which kept


Event = TokenEvent | PromptEvent | ProgressEvent | FinishEvent


class RequestHandle:
    """Stream of one request's events; iterate (threads) or `async for` (asyncio)."""

    def __init__(self, cancel: Callable[["RequestHandle"], None], n: int, loop: "asyncio.AbstractEventLoop | None"):
        self._cancel, self._n_open = cancel, n
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
        self._cancel(self)

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


class Outbox:
    """Events made by the engine's thread, not yet handed to their callers, in order."""

    def __init__(self):
        self._events: list[tuple[RequestHandle, Event]] = []

    def put(self, handle: RequestHandle, event: Event) -> None:
        self._events.append((handle, event))

    def __len__(self) -> int:
        return len(self._events)

    def deliver(self) -> None:
        """Hand the events over: to a thread's queue each, and to asyncio callers as one call per
        event loop for all of them (one wake-up of the loop a step, not one per token: at 64
        streams a step's events cost the engine's thread 64 of those)."""
        out, self._events = self._events, []
        by_loop: dict = {}
        for handle, event in out:
            if handle._loop is None:
                handle._sync.put(event)
            else:
                by_loop.setdefault(handle._loop, []).append((handle._aqueue, event))
        for loop, items in by_loop.items():
            call_in_loop(loop, put_all, items)


def put_all(items) -> None:
    """In an event loop: each (asyncio queue, event) pair, in order."""
    for q, ev in items:
        q.put_nowait(ev)


def call_in_loop(loop, fn, arg) -> None:
    """fn(arg) in the loop's thread; nothing where the loop is closed (its caller is gone)."""
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:
        pass
