"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Each handler parses the body into a prompt and `GenParams`, starts the engine requests and
formats the samples (or streams chunks). Sampling fields beyond OpenAI's (top_k, min_p,
repeat_penalty, ...) are accepted with llama-server's names.
"""
from __future__ import annotations

import secrets
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine import FinishEvent, TokenEvent
from .errors import APIError, invalid
from .fields import Fields, parse_json_object
from .generation import (Flight, GenParams, Sample, generation_error, parse_sampling, parse_stop, parse_stream,
                         start, timings, token_piece, usage)
from .grammars import requested_grammar
from .prompts import chat_prompt, completion_prompts, parse_messages, template_kwargs
from .sse import DONE, ClientGone, EventStream, event, until_disconnect
from .state import ServerModel, ServerState
from .replies import Output
from .tools import ToolSetup, parse_tools, protocol_for

FINGERPRINT = "ember"


# ---- shared parsing ----

async def read_body(request: Request) -> Fields:
    return Fields(parse_json_object(await request.body()))


def check_model(body: Fields, model: ServerModel) -> None:
    name = body.str("model")
    if not model.accepts(name):
        raise APIError(400, f"model {name!r} is not served here (this server runs {model.id!r})",
                       param="model", code="model_not_found")


def gen_params(body: Fields, model: ServerModel, state: ServerState, *, chat: bool) -> GenParams:
    cfg = state.config
    max_tokens = body.int("max_completion_tokens", None, lo=0) if chat else None
    if max_tokens is None:
        max_tokens = body.int("max_tokens", None, lo=0)
    stream, include_usage = parse_stream(body)
    return GenParams(
        max_tokens=model.n_ctx if max_tokens is None else max_tokens,
        n=body.int("n", 1, lo=1, hi=cfg.max_n), stop=parse_stop(body, cfg.max_stop),
        sampling=parse_sampling(body, model), logprobs=_logprobs(body, chat),
        stream=stream, include_usage=include_usage)


def _logprobs(body: Fields, chat: bool) -> int | None:
    if not chat:  # completions: logprobs is the number of alternatives
        return body.int("logprobs", None, lo=0, hi=20)
    wanted = body.bool("logprobs", False)
    top = body.int("top_logprobs", None, lo=0, hi=20)
    if top is not None and not wanted:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    return (top or 0) if wanted else None


def _new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def _finish_reason(sample: Sample, has_calls: bool) -> str:
    if has_calls:
        return "tool_calls"
    return "length" if sample.finish_reason == "length" else "stop"


def _token_logprob(model: ServerModel, token: int, logprob: float) -> dict:
    piece = token_piece(model, token)
    return {"token": piece.decode("utf-8", "replace"), "logprob": float(logprob), "bytes": list(piece)}


def chat_logprobs(model: ServerModel, ev: TokenEvent) -> dict:
    entry = _token_logprob(model, ev.token, ev.logprob)
    entry["top_logprobs"] = [_token_logprob(model, t, lp) for t, lp in ev.top_logprobs or ()]
    return entry


def completion_logprobs(model: ServerModel, events: list[TokenEvent], offset: int = 0) -> dict:
    """The legacy completions logprobs block."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ev in events:
        text = token_piece(model, ev.token).decode("utf-8", "replace")
        out["tokens"].append(text)
        out["token_logprobs"].append(float(ev.logprob))
        out["top_logprobs"].append({token_piece(model, t).decode("utf-8", "replace"): float(lp)
                                    for t, lp in ev.top_logprobs or ()})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


# ---- routes ----

async def list_models(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    model = state.require_model()
    meta = {"n_vocab": model.model.n_vocab, "n_ctx_train": model.model.n_ctx_train, "n_ctx": model.n_ctx,
            "size": model.path.stat().st_size}
    return JSONResponse({"object": "list", "data": [
        {"id": model.id, "object": "model", "created": int(state.started), "owned_by": "ember", "meta": meta}]})


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    model = state.require_model()
    body = await read_body(request)
    check_model(body, model)
    messages = parse_messages(body)
    setup = parse_tools(body)
    gen = gen_params(body, model, state, chat=True)
    gen.grammar, gen.grammar_param = _chat_grammar(body, model, setup)
    prompt = chat_prompt(model, messages, setup, template_kwargs(body))
    flight = start(state, model, [prompt], gen, request)
    protocol = protocol_for(model.native_tools)
    outputs = [protocol.output(setup) for _ in flight.samples]
    meta = {"id": _new_id("chatcmpl"), "created": int(time.time()), "model": model.id,
            "system_fingerprint": FINGERPRINT}
    if gen.stream:
        return EventStream(_chat_stream(flight, outputs, meta, gen, model))
    try:
        samples = await until_disconnect(request.receive, flight.collect())
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse(_chat_result(samples, outputs, meta, gen, model, flight.submitted))


def _chat_grammar(body: Fields, model: ServerModel, setup: ToolSetup):
    spec, param = requested_grammar(body)
    tool_spec = protocol_for(model.native_tools).grammar(setup)
    if tool_spec is not None and spec is not None:
        raise invalid(param, f"{param} cannot be combined with tools (unless tool_choice is \"none\")",
                      "conflicting_fields")
    return (tool_spec, "tools") if tool_spec is not None else (spec, param)


def _chat_result(samples, outputs, meta, gen: GenParams, model: ServerModel, submitted: float) -> dict:
    choices = []
    for s, out in zip(samples, outputs):
        _, reply = out.finish(s.text)
        message = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = [c.openai() for c in reply.tool_calls]
        logprobs = {"content": [chat_logprobs(model, ev) for ev in s.logprobs]} if gen.logprobs is not None else None
        choices.append({"index": s.index, "message": message, "logprobs": logprobs,
                        "finish_reason": _finish_reason(s, bool(reply.tool_calls))})
    return {**meta, "object": "chat.completion", "choices": choices, "usage": usage(samples, gen.n),
            "timings": timings(samples[0], submitted)}


async def _chat_stream(flight: Flight, outputs: list[Output], meta: dict, gen: GenParams, model: ServerModel):
    def chunk(index: int, delta: dict, finish: str | None = None, logprobs=None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return event({**meta, "object": "chat.completion.chunk", "choices": [choice]})

    try:
        for i in range(len(outputs)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for index, ev in flight:
            if isinstance(ev, TokenEvent):
                deltas = outputs[index].feed(ev.text)
                if gen.logprobs is not None:
                    yield chunk(index, _merged(deltas), logprobs={"content": [chat_logprobs(model, ev)]})
                else:
                    for d in deltas:
                        yield chunk(index, d)
                continue
            if ev.reason in ("error", "cancelled"):
                yield stream_failure(ev)
                return
            deltas, reply = outputs[index].finish(ev.text)
            for d in deltas:
                yield chunk(index, d)
            yield chunk(index, {}, _finish_reason(flight.samples[index], bool(reply.tool_calls)))
        if gen.include_usage:
            yield event({**meta, "object": "chat.completion.chunk", "choices": [],
                         "usage": usage(flight.samples, gen.n)})
        yield DONE
    finally:
        flight.close()


def _merged(deltas: list[dict]) -> dict:
    """Several deltas of one token as one (for chunks that carry that token's logprobs)."""
    out: dict = {}
    for d in deltas:
        if "content" in d:
            out["content"] = out.get("content", "") + d["content"]
        if "tool_calls" in d:
            out.setdefault("tool_calls", []).extend(d["tool_calls"])
    return out


def stream_failure(ev: FinishEvent) -> bytes:
    if ev.reason == "cancelled":
        err = APIError(503, "the request was cancelled: the server is shutting down", type="unavailable_error",
                       code="cancelled")
    else:
        err = generation_error(ev.error, ev.code)
    return err.sse()


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    model = state.require_model()
    body = await read_body(request)
    check_model(body, model)
    if body.bool("echo", False):
        raise invalid("echo", "echo is not supported", "unsupported")
    if body.has("suffix"):
        raise invalid("suffix", "suffix (fill-in-the-middle) is not supported", "unsupported")
    gen = gen_params(body, model, state, chat=False)
    gen.grammar, gen.grammar_param = requested_grammar(body)
    prompts = completion_prompts(body, model)
    flight = start(state, model, prompts, gen, request)
    meta = {"id": _new_id("cmpl"), "created": int(time.time()), "model": model.id,
            "system_fingerprint": FINGERPRINT}
    if gen.stream:
        return EventStream(_completion_stream(flight, meta, gen, model))
    try:
        samples = await until_disconnect(request.receive, flight.collect())
    except ClientGone:
        return Response(status_code=499)
    choices = [{"index": s.index, "text": s.text, "finish_reason": _finish_reason(s, False),
                "logprobs": completion_logprobs(model, s.logprobs) if gen.logprobs is not None else None}
               for s in samples]
    return JSONResponse({**meta, "object": "text_completion", "choices": choices, "usage": usage(samples, gen.n),
                         "timings": timings(samples[0], flight.submitted)})


async def _completion_stream(flight: Flight, meta: dict, gen: GenParams, model: ServerModel):
    def chunk(index: int, text: str, finish: str | None = None, logprobs=None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return event({**meta, "object": "text_completion", "choices": [choice]})

    offsets = [0] * len(flight.samples)
    try:
        async for index, ev in flight:
            if isinstance(ev, TokenEvent):
                lp = completion_logprobs(model, [ev], offsets[index]) if gen.logprobs is not None else None
                offsets[index] += len(ev.text)
                if ev.text or lp:
                    yield chunk(index, ev.text, logprobs=lp)
                continue
            if ev.reason in ("error", "cancelled"):
                yield stream_failure(ev)
                return
            yield chunk(index, ev.text, _finish_reason(flight.samples[index], False))
        if gen.include_usage:
            yield event({**meta, "object": "text_completion", "choices": [], "usage": usage(flight.samples, gen.n)})
        yield DONE
    finally:
        flight.close()
