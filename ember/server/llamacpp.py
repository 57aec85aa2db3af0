"""llama-server's own routes, with its field names: /completion (also /completions), /tokenize,
/detokenize, /apply-template, /health, /props, /slots.

`cache_prompt` and `id_slot` are accepted and have no effect: ember's prefix cache is shared
by every request, so there is no per-slot cache to pick or to skip.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .. import __version__
from ..engine import TokenEvent
from ..sampler import SamplingParams
from ..sampler.params import RANDOM_SEED
from .errors import invalid
from .fields import Fields
from .generation import (Flight, GenParams, Sample, check_sequences, max_tokens, off_loop, parse_sampling,
                         parse_stop, start, timings, token_piece)
from .grammars import requested_grammar
from .openai import json_reply, read_body, stream_failure
from .prompts import check_token, completion_prompts, parse_messages, prompt_items, render_chat, template_options
from .sse import ClientGone, EventStream, event, until_disconnect
from .state import ServerModel, ServerState
from .tools import parse_tools


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    if state.draining:
        return _unavailable("Shutting down")
    if state.model is None and not state.sleeping:
        return _unavailable(f"Model failed to load: {state.load_error}" if state.load_error else "Loading model")
    return JSONResponse({"status": "ok"})


def _unavailable(message: str) -> Response:
    return JSONResponse({"error": {"code": 503, "message": message, "type": "unavailable_error"}}, status_code=503,
                        headers={"Retry-After": "1"})


# ---- /completion ----

@dataclass(slots=True)
class CompletionJob:
    gen: GenParams
    prompts: list[list[int]]
    return_tokens: bool = False
    fields: tuple[str, ...] = ()  # response_fields: "a/b" paths; empty: every field
    progress: bool = False  # return_progress
    per_token_timings: bool = False  # timings_per_token


def prepare_completion(body: Fields, model: ServerModel, state: ServerState) -> CompletionJob:
    body.str("model")  # any name: one model is served
    n_predict = body.int("n_predict", None, lo=-1)
    if n_predict is None:
        n_predict = body.int("max_tokens", None, lo=-1)
    n_probs = body.int("n_probs", 0, lo=0, hi=100)
    gen = GenParams(max_tokens=max_tokens(n_predict, state.config, model), stop=parse_stop(body, state.config.max_stop),
                    sampling=parse_sampling(body, model, state.config), logprobs=n_probs or None,
                    stream=body.bool("stream", False))
    gen.grammar, gen.grammar_param = requested_grammar(body)
    body.bool("cache_prompt", True)  # type-checked, no effect (see module doc)
    body.int("id_slot", -1, lo=-1)
    job = CompletionJob(gen, [], body.bool("return_tokens", False), body.strings("response_fields"),
                        body.bool("return_progress", False), body.bool("timings_per_token", False))
    items = prompt_items(body)
    if gen.stream and len(items) > 1:
        raise invalid("prompt", "streaming takes one prompt per request", "unsupported")
    check_sequences(len(items), 1, state.config)
    job.prompts = completion_prompts(items, model)
    return job


async def completion(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    async with state.using_model() as model:
        body = await read_body(request)
        job = await off_loop(prepare_completion, body, model, state)
        flight = await start(state, model, job.prompts, job.gen, request)
    if job.gen.stream:
        return EventStream(_completion_stream(flight, job, model))
    try:
        samples = await until_disconnect(request.receive, flight.collect())
    except ClientGone:
        return Response(status_code=499)
    results = [_picked(_result(s, job, model, flight), job.fields) for s in samples]
    return JSONResponse(results[0] if len(results) == 1 else results)


def _result(s: Sample, job: CompletionJob, model: ServerModel, flight: Flight) -> dict:
    stop_type, word = _stop_type(s, job.gen, model)
    prompt = flight.prompts[s.index]
    out = {"index": s.index, "content": s.text, "tokens": s.tokens if job.return_tokens else [], "id_slot": -1,
           "stop": True, "model": model.id, "tokens_predicted": len(s.tokens), "tokens_evaluated": len(prompt),
           "generation_settings": generation_settings(job.gen, job.per_token_timings),
           "prompt": model.tokenizer.decode(prompt, special=True), "has_new_line": "\n" in s.text,
           "truncated": False, "stop_type": stop_type, "stopping_word": word, "tokens_cached": s.cached_tokens,
           "timings": timings(s, flight.submitted)}
    if job.gen.logprobs is not None:
        out["completion_probabilities"] = [_probs(model, ev, job.gen) for ev in s.logprobs]
    return out


def _picked(result: dict, fields: tuple[str, ...]) -> dict:
    """response_fields: only these fields, each path ("timings/prompt_n") a key of its own."""
    if not fields:
        return result
    out = {}
    for path in fields:
        value = result
        for key in path.split("/"):
            value = value.get(key, _MISSING) if isinstance(value, dict) else _MISSING
        if value is not _MISSING:
            out[path] = value
    return out


_MISSING = object()


def generation_settings(gen: GenParams, per_token_timings: bool = False) -> dict:
    """The settings a request ran with, in llama-server's shape."""
    return {**sampling_settings(gen.sampling), "n_predict": gen.max_tokens, "max_tokens": gen.max_tokens,
            "stop": list(gen.stop), "stream": gen.stream, "n_probs": gen.logprobs or 0,
            "grammar": gen.grammar.gbnf if gen.grammar else "",
            "grammar_lazy": bool(gen.grammar and gen.grammar.lazy_triggers), "timings_per_token": per_token_timings}


def sampling_settings(params: SamplingParams) -> dict:
    out = asdict(params)
    out["seed"] = RANDOM_SEED if params.random_seed else params.seed
    out["logit_bias"] = [[t, b if math.isfinite(b) else False] for t, b in params.logit_bias]  # False: banned
    return out


def _stop_type(s: Sample, gen: GenParams, model: ServerModel) -> tuple[str, str]:
    """Why it stopped, as llama-server says it: "eos", "word" (and which) or "limit"."""
    if s.finish_reason == "length":
        return "limit", ""
    raw = model.tokenizer.decode(s.tokens)
    hits = [(raw.find(w), w) for w in gen.stop if w in raw]
    return ("word", min(hits)[1]) if hits else ("eos", "")


def _probs(model: ServerModel, ev: TokenEvent, gen: GenParams) -> dict:
    """One completion_probabilities entry (probabilities instead of logprobs when
    post_sampling_probs is set, as llama-server does)."""
    post = gen.sampling.post_sampling_probs

    def entry(token: int, logprob: float) -> dict:
        piece = token_piece(model, token)
        value = {"prob": math.exp(logprob)} if post else {"logprob": float(logprob)}
        return {"id": int(token), "token": piece.decode("utf-8", "replace"), "bytes": list(piece), **value}

    top = [entry(t, lp) for t, lp in ev.top_logprobs or ()]
    return {**entry(ev.token, ev.logprob), ("top_probs" if post else "top_logprobs"): top}


async def _completion_stream(flight: Flight, job: CompletionJob, model: ServerModel):
    """One event per token (with its id, as llama-server streams them), a prompt-progress
    event before the first with return_progress, and the whole result last (stop: true)."""
    gen = job.gen
    try:
        async for index, ev in flight:
            sample = flight.samples[index]
            if isinstance(ev, TokenEvent):
                if job.progress and len(sample.tokens) == 1:
                    yield event(_progress(flight, index, job))
                chunk = {"index": index, "content": ev.text, "tokens": [ev.token], "stop": False, "id_slot": -1,
                         "tokens_predicted": len(sample.tokens), "tokens_evaluated": len(flight.prompts[index])}
                if gen.logprobs is not None:
                    chunk["completion_probabilities"] = [_probs(model, ev, gen)]
                if job.per_token_timings:
                    chunk["timings"] = timings(sample, flight.submitted)
                yield event(chunk)
            elif ev.reason in ("error", "cancelled"):
                yield stream_failure(ev)
                return
            else:
                final = _result(sample, job, model, flight)
                yield event(_picked({**final, "content": ev.text, "tokens": []}, job.fields))
    finally:
        flight.close()


def _progress(flight: Flight, index: int, job: CompletionJob) -> dict:
    """The prompt is processed: llama-server's prompt_progress (total, cache, processed, time_ms)."""
    sample, n = flight.samples[index], len(flight.prompts[index])
    cached = flight.cached_tokens(index)
    elapsed = int((sample.first_at - flight.submitted) * 1000)
    out = {"index": index, "content": "", "tokens": [], "stop": False, "id_slot": -1, "tokens_predicted": 0,
           "tokens_evaluated": n, "prompt_progress": {"total": n, "cache": cached, "processed": n, "time_ms": elapsed}}
    if job.per_token_timings:
        before = Sample(index, prompt_tokens=n, cached_tokens=cached, first_at=sample.first_at, last_at=sample.first_at)
        out["timings"] = timings(before, flight.submitted)
    return out


# ---- tokens and templates ----

def _tokenize_reply(body: Fields, model: ServerModel) -> dict:
    content = body.str("content")
    if content is None:
        raise invalid("content", "content is required", "missing_field")
    ids = model.tokenizer.encode(content, add_special=body.bool("add_special", False),
                                 parse_special=body.bool("parse_special", True))
    if not body.bool("with_pieces", False):
        return {"tokens": ids}
    return {"tokens": [{"id": t, "piece": _piece(model, t)} for t in ids]}


async def tokenize(request: Request) -> Response:
    async with request.app.state.ember.using_model() as model:
        body = await read_body(request)
        return await json_reply(await off_loop(_tokenize_reply, body, model))


def _piece(model: ServerModel, token: int):
    """A token's text, or its bytes when they are not valid UTF-8 on their own."""
    raw = token_piece(model, token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _detokenize_reply(body: Fields, model: ServerModel) -> dict:
    tokens = body.list("tokens", [])
    ids = []
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int):
            raise invalid(f"tokens[{i}]", f"tokens[{i}] must be a token id", "invalid_type")
        ids.append(check_token(model, t, f"tokens[{i}]"))
    return {"content": model.tokenizer.decode(ids)}


async def detokenize(request: Request) -> Response:
    async with request.app.state.ember.using_model() as model:
        body = await read_body(request)
        return await json_reply(await off_loop(_detokenize_reply, body, model))


def _template_reply(body: Fields, model: ServerModel) -> dict:
    messages = parse_messages(body)
    setup = parse_tools(body)
    options = template_options(body, messages, setup)
    return {"prompt": render_chat(model, messages, setup, options).text}


async def apply_template(request: Request) -> Response:
    async with request.app.state.ember.using_model() as model:
        body = await read_body(request)
        return await json_reply(await off_loop(_template_reply, body, model))


# ---- server state ----

async def props(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    info = state.require_info()
    gen = GenParams(max_tokens=state.config.n_predict, sampling=state.config.sampling_defaults())
    return JSONResponse({
        "default_generation_settings": {"n_ctx": info.n_ctx, "params": generation_settings(gen)},
        "total_slots": info.slots, "model_path": str(info.path), "model_alias": info.id,
        "chat_template": info.template_text, "chat_template_source": info.template_source,
        "chat_template_tools": "tagged" if info.native_tools else "generic",
        "bos_token": info.bos_token, "eos_token": info.eos_token,
        "modalities": {"vision": False, "audio": False}, "build_info": f"ember {__version__}",
        "is_sleeping": state.sleeping, "kv_cache": {"pages": info.kv_pages, "page_size": info.page_size}})


async def slots(request: Request) -> Response:
    """One entry per slot: a running sequence or idle. Slots are not tied to a cache here."""
    state: ServerState = request.app.state.ember
    info = state.require_info()
    running = list(state.model.engine.scheduler.running) if state.model is not None else []
    return JSONResponse([_slot(i, running[i] if i < len(running) else None, info.n_ctx)
                         for i in range(max(info.slots, len(running)))])


def _slot(i: int, seq, n_ctx: int) -> dict:
    decoded = seq.n_generated if seq else 0  # read once: the engine thread goes on appending
    return {"id": i, "n_ctx": n_ctx, "speculative": False, "is_processing": seq is not None,
            "id_task": seq.id if seq else -1, "n_prompt_tokens": seq.n_prompt if seq else 0,
            "n_prompt_tokens_cache": seq.n_cache_hit if seq else 0,
            "n_prompt_tokens_processed": seq.n_prompt - seq.n_cache_hit if seq else 0,
            "n_cached_tokens": seq.n_cache_hit if seq else 0,
            "next_token": [{"has_next_token": seq is not None, "n_decoded": decoded,
                            "n_remain": seq.max_new_tokens - decoded if seq else -1}]}


async def slot_action(request: Request) -> Response:
    """POST /slots/{id}?action=erase drops cached prompts. The prefix cache is shared by all
    slots here, so erasing any slot empties it (entries in use by running sequences stay)."""
    state: ServerState = request.app.state.ember
    info = state.require_info()
    slot, action = request.path_params["id_slot"], request.query_params.get("action")
    if not 0 <= slot < info.slots:
        raise invalid("id_slot", f"no slot {slot} (this server has {info.slots})")
    if action != "erase":
        raise invalid("action", f"slot action {action!r} is not supported (only erase)", "unsupported")
    if state.sleeping:  # the cache went with the model
        return JSONResponse({"id_slot": slot, "n_erased": 0})
    model = state.require_model()
    cached = model.engine.kv_usage().cached_tokens
    model.engine.clear_cache()
    return JSONResponse({"id_slot": slot, "n_erased": cached})
