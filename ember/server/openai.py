"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Each handler reads its body, prepares the prompt and `GenParams` off the event loop, starts the
engine requests and formats the samples (or streams chunks). Sampling fields beyond OpenAI's
(top_k, min_p, repeat_penalty, ...) are accepted with llama-server's names. With one model
served, any `model` name is accepted (clients send their own, like "gpt-4o"); replies name the
served model.
"""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine import FinishEvent, TokenEvent
from .errors import APIError, invalid
from .fields import Fields, parse_json_object
from .generation import (Flight, GenParams, Sample, check_sequences, generation_error, max_tokens, off_loop,
                         parse_sampling, parse_stop, parse_stream, start, timings, token_piece, usage)
from .grammars import requested_grammar
from .prompts import ChatPrompt, chat_prompt, completion_prompts, parse_messages, prompt_items, template_options
from .sse import DONE, ClientGone, EventStream, event, until_disconnect
from .state import ModelInfo, ServerModel, ServerState
from .replies import Output
from .tools import ToolSetup, parse_tools, protocol_for

FINGERPRINT = "ember"
BIG_BODY = 1 << 16  # bytes; bodies past this are parsed off the event loop


# ---- shared parsing ----

async def read_body(request: Request) -> Fields:
    raw = await request.body()
    data = await off_loop(parse_json_object, raw) if len(raw) > BIG_BODY else parse_json_object(raw)
    return Fields(data)


def gen_params(body: Fields, model: ServerModel, state: ServerState, *, chat: bool) -> GenParams:
    cfg = state.config
    body.str("model")  # any name: one model is served
    limit = body.int("max_completion_tokens", None, lo=0) if chat else None
    if limit is None:
        limit = body.int("max_tokens", None, lo=0)
    stream, include_usage = parse_stream(body)
    return GenParams(
        max_tokens=max_tokens(limit, cfg, model), n=body.int("n", 1, lo=1, hi=cfg.max_sequences),
        stop=parse_stop(body, cfg.max_stop), sampling=parse_sampling(body, model, cfg),
        logprobs=_logprobs(body, chat), stream=stream, include_usage=include_usage)


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


async def json_reply(payload) -> Response:
    """A JSON response rendered off the loop (a /tokenize of 10 MB has millions of ids)."""
    return Response(await off_loop(_json_bytes, payload), media_type="application/json")


def _json_bytes(payload) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


# ---- routes ----

async def list_models(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    info = state.require_info()
    return JSONResponse(models_reply(info, state))


def models_reply(info: ModelInfo, state: ServerState) -> dict:
    """llama-server's reply: OpenAI's list (with aliases and tags) and Ollama's `models`."""
    meta = {"n_vocab": info.n_vocab, "n_ctx_train": info.n_ctx_train, "n_ctx": info.n_ctx, "size": info.size}
    tags = list(state.config.tags)
    return {"object": "list", "data": [
        {"id": info.id, "aliases": list(info.aliases), "tags": tags, "object": "model", "created": int(state.started),
         "owned_by": "ember", "meta": meta}],
        "models": [{"name": info.id, "model": info.id, "modified_at": "", "size": str(info.size), "digest": "",
                    "type": "model", "description": "", "tags": tags, "capabilities": ["completion"],
                    "parameters": "", "details": {"parent_model": "", "format": "gguf", "family": "",
                                                  "families": [], "parameter_size": "", "quantization_level": ""}}]}


@dataclass(slots=True)
class ChatJob:
    gen: GenParams
    setup: ToolSetup
    prompt: ChatPrompt


def prepare_chat(body: Fields, model: ServerModel, state: ServerState) -> ChatJob:
    messages = parse_messages(body)
    setup = parse_tools(body)
    options = template_options(body, messages, setup)
    gen = gen_params(body, model, state, chat=True)
    gen.grammar, gen.grammar_param = _chat_grammar(body, model, setup)
    return ChatJob(gen, setup, chat_prompt(model, messages, setup, options))


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    async with state.using_model() as model:
        body = await read_body(request)
        job = await off_loop(prepare_chat, body, model, state)
        flight = await start(state, model, [job.prompt.ids], job.gen, request)
    outputs = [protocol_for(model.native_tools).output(job.setup) for _ in flight.samples]
    meta = {"id": _new_id("chatcmpl"), "created": int(time.time()), "model": model.id,
            "system_fingerprint": FINGERPRINT}
    prefill = [out.feed(job.prompt.prefill) for out in outputs]  # the reply continues that message
    if job.gen.stream:
        return EventStream(_chat_stream(flight, outputs, prefill, meta, job.gen, model))
    try:
        samples = await until_disconnect(request.receive, flight.collect())
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse(_chat_result(samples, outputs, meta, job.gen, model, flight.submitted))


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


async def _chat_stream(flight: Flight, outputs: list[Output], prefill: list[list[dict]], meta: dict, gen: GenParams,
                       model: ServerModel):
    """Chunks as llama-server sends them: a first delta with the role and `content: null`, the
    content, each choice's finish, and `timings` on the last chunk (the usage chunk, if asked)."""
    def chunk(index: int, delta: dict, finish: str | None = None, logprobs=None, **extra) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return event({**meta, "object": "chat.completion.chunk", "choices": [choice], **extra})

    try:
        for i in range(len(outputs)):
            yield chunk(i, {"role": "assistant", "content": None})
            for d in prefill[i]:
                yield chunk(i, d)
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
            sample = flight.samples[index]
            extra = {} if gen.include_usage else {"timings": timings(sample, flight.submitted)}
            yield chunk(index, {}, _finish_reason(sample, bool(reply.tool_calls)), **extra)
        if gen.include_usage:
            yield event({**meta, "object": "chat.completion.chunk", "choices": [],
                         "usage": usage(flight.samples, gen.n),
                         "timings": timings(flight.samples[0], flight.submitted)})
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


def prepare_completions(body: Fields, model: ServerModel, state: ServerState) -> tuple[GenParams, list[list[int]]]:
    if body.bool("echo", False):
        raise invalid("echo", "echo is not supported", "unsupported")
    if body.has("suffix"):
        raise invalid("suffix", "suffix (fill-in-the-middle) is not supported", "unsupported")
    gen = gen_params(body, model, state, chat=False)
    gen.grammar, gen.grammar_param = requested_grammar(body)
    items = prompt_items(body)
    check_sequences(len(items), gen.n, state.config)
    return gen, completion_prompts(items, model)


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    async with state.using_model() as model:
        body = await read_body(request)
        gen, prompts = await off_loop(prepare_completions, body, model, state)
        flight = await start(state, model, prompts, gen, request)
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
