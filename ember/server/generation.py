"""Between the routes and the engine: the generation fields every route shares, submitting
requests (engine errors -> HTTP errors), and following them while they run.

A route parses its body into `GenParams` (plus its prompt), calls `start`, then either
collects the `Sample`s or streams the events of the returned `Flight`. Parsing, prompt building
and submitting run off the event loop (`off_loop`): rendering, tokenizing and compiling a
grammar of a big request take long enough to stall every other client.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field, fields as dataclass_fields

from starlette.concurrency import run_in_threadpool as off_loop
from starlette.requests import Request as HTTPRequest

from ..engine import EngineClosed, FinishEvent, QueueFull, Request, RequestHandle, TokenEvent
from ..engine.engine import GrammarSpec
from ..gbnf import GrammarError
from ..sampler import NoTokenAllowed, SamplingParams
from .errors import APIError, context_exceeded, invalid, not_ready, queue_full, server_error
from .fields import Fields
from .state import ServerConfig, ServerModel, ServerState

# request keys that are sampling parameters (llama-server's names; OpenAI's are a subset)
SAMPLING_KEYS = frozenset(f.name for f in dataclass_fields(SamplingParams)) | {"temp", "typ_p"}
SPELLINGS = {"temperature": {"temperature", "temp"}, "typical_p": {"typical_p", "typ_p"}}


@dataclass(slots=True)
class GenParams:
    max_tokens: int
    n: int = 1
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: int | None = None  # None: none; k: the chosen token's plus the top k
    grammar: GrammarSpec | None = None
    grammar_param: str | None = None  # the field the grammar came from (for errors)
    stream: bool = False
    include_usage: bool = False


def parse_sampling(body: Fields, model: ServerModel, config: ServerConfig) -> SamplingParams:
    """SamplingParams from the body's sampling fields over the server's defaults; 400 naming
    the field that is wrong."""
    given = {k: v for k, v in body.data.items() if k in SAMPLING_KEYS and v is not None}
    for key, value in config.sampling:
        if not given.keys() & SPELLINGS.get(key, {key}):
            given[key] = value
    try:
        params = SamplingParams.from_dict(given)
    except (ValueError, TypeError) as e:
        raise invalid(_failing_key(given), str(e)) from None
    _check_bias_ids(params, model)
    return params


def _failing_key(given: dict) -> str | None:
    for key, value in given.items():
        try:
            SamplingParams.from_dict({key: value})
        except (ValueError, TypeError):
            return key
    return None


def _check_bias_ids(params: SamplingParams, model: ServerModel) -> None:
    n_vocab = model.model.n_vocab
    for token, _ in params.logit_bias:
        if isinstance(token, int) and token >= n_vocab:
            raise invalid("logit_bias", f"logit_bias: token id {token} is outside the vocabulary (0..{n_vocab - 1})")


def parse_stream(body: Fields) -> tuple[bool, bool]:
    """stream and stream_options.include_usage."""
    stream = body.bool("stream", False)
    options = body.object("stream_options")
    include_usage = bool(options and options.bool("include_usage", False))
    if options is not None and not stream:
        raise invalid("stream_options", "stream_options is only allowed with stream: true")
    return stream, include_usage


MAX_STOP_CHARS = 1000  # the longest stop string (the count is ServerConfig.max_stop)


def parse_stop(body: Fields, max_items: int) -> tuple[str, ...]:
    stops = body.strings("stop", max_items)
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            name = "stop" if isinstance(body.data.get("stop"), str) else f"stop[{i}]"
            raise invalid(name, f"{name} has {len(s)} characters; a stop string may have at most {MAX_STOP_CHARS}")
    return tuple(s for s in stops if s)


def max_tokens(given: int | None, config: ServerConfig, model: ServerModel) -> int:
    """A request's token limit: its own, else the server's default (-1: until the context is full)."""
    limit = config.n_predict if given is None or given == -1 else given
    return model.n_ctx if limit == -1 else limit


def check_sequences(n_prompts: int, n: int, config: ServerConfig, param: str = "prompt") -> None:
    """One request may not fill the queue: prompts x n is capped."""
    if n_prompts * n > config.max_sequences:
        raise invalid(param, f"{n_prompts} prompt(s) with n={n} ask for {n_prompts * n} sequences; a request may ask "
                             f"for at most {config.max_sequences} (prompts x n)", "too_many_sequences")


def check_prompt_fits(ids: list[int], model: ServerModel, param: str) -> None:
    if not ids:
        raise invalid(param, "the prompt is empty", "empty_prompt")
    if len(ids) > model.n_ctx:
        raise context_exceeded(param, len(ids), model.n_ctx)


async def start(state: ServerState, model: ServerModel, prompts: list[list[int]], gen: GenParams,
                http: HTTPRequest | None = None) -> "Flight":
    """Submit one engine request per prompt from the client `http` names (off the loop: a new
    grammar compiles then); engine refusals become HTTP errors."""
    client = client_key(state, http) if http is not None else ""
    try:
        handles = await off_loop(_submit, model, prompts, gen, client, asyncio.get_running_loop())
    except Exception as e:
        raise _submit_error(state, e, gen) from None
    if state.draining:  # began while the requests were prepared
        for h in handles:
            h.cancel()
        raise not_ready("the server is shutting down")
    state.stats.requests += 1
    return Flight(state, handles, gen.n, prompts)


def _submit(model: ServerModel, prompts: list[list[int]], gen: GenParams, client: str, loop) -> list[RequestHandle]:
    handles: list[RequestHandle] = []
    try:
        for ids in prompts:
            handles.append(model.engine.submit_async(Request(
                ids, gen.max_tokens, gen.sampling, gen.stop, gen.n, gen.logprobs, grammar=gen.grammar,
                client=client), loop))
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


def _submit_error(state: ServerState, e: BaseException, gen: GenParams) -> BaseException:
    if isinstance(e, QueueFull):
        state.stats.rejected_queue_full += 1
        return queue_full(f"the server is busy ({e}); retry later")
    if isinstance(e, EngineClosed):
        return not_ready("the server is shutting down")
    if isinstance(e, GrammarError):
        return invalid(gen.grammar_param or "grammar", f"invalid grammar: {e}", "invalid_grammar")
    if isinstance(e, NoTokenAllowed):
        return invalid("logit_bias", str(e), e.code)
    if isinstance(e, ValueError):
        code = "context_length_exceeded" if "context holds" in str(e) else "invalid_value"
        return invalid(None, str(e), code)
    return e


@dataclass(slots=True)
class Sample:
    """One finished (or finishing) sample: its text, tokens and how it ended."""

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


class Flight:
    """The engine requests of one HTTP request while they run. Iterate for (choice index,
    event); leaving early (an exception, a disconnect, a closed stream) cancels them."""

    def __init__(self, state: ServerState, handles: list[RequestHandle], n: int, prompts: list[list[int]]):
        self.state, self.handles, self.n = state, handles, n
        self.prompts = [p for p in prompts for _ in range(n)]  # per choice index
        self.submitted = time.perf_counter()
        self.samples = [Sample(i) for i in range(len(handles) * n)]
        self._iters = [h.__aiter__() for h in handles]
        self._next: dict[int, asyncio.Future] = {}
        self._open = set(range(len(handles)))
        state.active.update(handles)

    @property
    def finished(self) -> bool:
        return not self._open

    def cached_tokens(self, index: int) -> int:
        """Prompt tokens of choice `index` found in the prefix cache (known once it is admitted)."""
        return self.handles[index // self.n].seqs[index % self.n].n_cache_hit

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, TokenEvent | FinishEvent]:
        while self._open:
            k, ev = await self._next_event()
            if ev is None:
                self._open.discard(k)
                continue
            if isinstance(ev, (TokenEvent, FinishEvent)):
                index = k * self.n + ev.index
                self._record(index, ev)
                return index, ev
        self.close()
        raise StopAsyncIteration

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
        """Run to the end; the samples in choice order. Engine failures become 500s."""
        try:
            async for _ in self:
                pass
        finally:
            self.close()
        for s in self.samples:
            if s.finish_reason == "error":
                raise generation_error(s.error, s.error_code)
            if s.finish_reason == "cancelled":
                raise not_ready("the request was cancelled: the server is shutting down")
        return self.samples


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


def usage(samples: list[Sample], n: int) -> dict:
    """OpenAI's usage block; each prompt counts once however many samples share it."""
    firsts = samples[::n]
    prompt = sum(s.prompt_tokens for s in firsts)
    cached = sum(min(x.cached_tokens for x in samples[i:i + n]) for i in range(0, len(samples), n))
    completion = sum(len(s.tokens) for s in samples)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def timings(sample: Sample, submitted: float) -> dict:
    """llama-server's `timings` block for one sample."""
    prompt_ms = max(sample.first_at - submitted, 0.0) * 1000 if sample.first_at else 0.0
    predicted_ms = (sample.last_at - sample.first_at) * 1000 if sample.first_at else 0.0
    prompt_n = sample.prompt_tokens - sample.cached_tokens
    predicted_n = len(sample.tokens)
    return {"cache_n": sample.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n / prompt_ms * 1000 if prompt_ms else 0.0,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / (predicted_n - 1) if predicted_n > 1 else 0.0,
            "predicted_per_second": (predicted_n - 1) / predicted_ms * 1000 if predicted_ms else 0.0}


def token_piece(model: ServerModel, token: int) -> bytes:
    return model.tokenizer.token_to_piece(token, special=True)
