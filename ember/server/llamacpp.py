"""llama-server's own routes, with its field names: /completion, /tokenize, /detokenize,
/apply-template, /health, /props, /slots.

`cache_prompt` and `id_slot` are accepted and have no effect: ember's prefix cache is shared
by every request, so there is no per-slot cache to pick or to skip.
"""
from __future__ import annotations

import math
from dataclasses import asdict

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .. import __version__
from ..engine import TokenEvent
from .errors import invalid
from .fields import Fields
from .generation import (Flight, GenParams, Sample, parse_sampling, parse_stop, start, timings, token_piece)
from .grammars import requested_grammar
from .openai import check_model, read_body, stream_failure
from .prompts import check_token, completion_prompts, parse_messages, render_chat, template_kwargs
from .sse import ClientGone, EventStream, event, until_disconnect
from .state import ServerModel, ServerState
from .tools import parse_tools


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    if state.draining:
        return _unavailable("Shutting down")
    if state.model is None:
        return _unavailable(f"Model failed to load: {state.load_error}" if state.load_error else "Loading model")
    return JSONResponse({"status": "ok"})


def _unavailable(message: str) -> Response:
    return JSONResponse({"error": {"code": 503, "message": message, "type": "unavailable_error"}}, status_code=503)


# ---- /completion ----

def completion_params(body: Fields, model: ServerModel, state: ServerState) -> GenParams:
    n_predict = body.int("n_predict", None, lo=-1)
    if n_predict is None:
        n_predict = body.int("max_tokens", -1, lo=-1)
    n_probs = body.int("n_probs", 0, lo=0, hi=100)
    gen = GenParams(max_tokens=model.n_ctx if n_predict == -1 else n_predict, stop=parse_stop(body, state.config.max_stop),
                    sampling=parse_sampling(body, model), logprobs=n_probs or None,
                    stream=body.bool("stream", False))
    gen.grammar, gen.grammar_param = requested_grammar(body)
    body.bool("cache_prompt", True)  # type-checked, no effect (see module doc)
    body.int("id_slot", -1, lo=-1)
    return gen


async def completion(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    model = state.require_model()
    body = await read_body(request)
    check_model(body, model)
    gen = completion_params(body, model, state)
    return_tokens = body.bool("return_tokens", False)
    prompts = completion_prompts(body, model)
    if gen.stream and len(prompts) > 1:
        raise invalid("prompt", "streaming takes one prompt per request", "unsupported")
    flight = start(state, model, prompts, gen, request)
    if gen.stream:
        return EventStream(_completion_stream(flight, gen, model, return_tokens))
    try:
        samples = await until_disconnect(request.receive, flight.collect())
    except ClientGone:
        return Response(status_code=499)
    results = [_result(s, gen, model, return_tokens, flight.submitted) for s in samples]
    return JSONResponse(results[0] if len(results) == 1 else results)


def _result(s: Sample, gen: GenParams, model: ServerModel, return_tokens: bool, submitted: float) -> dict:
    stop_type, word = _stop_type(s, gen, model)
    out = {"index": s.index, "content": s.text, "tokens": s.tokens if return_tokens else [], "id_slot": -1,
           "stop": True, "model": model.id, "tokens_predicted": len(s.tokens), "tokens_evaluated": s.prompt_tokens,
           "tokens_cached": s.cached_tokens, "truncated": False, "stop_type": stop_type, "stopping_word": word,
           "timings": timings(s, submitted)}
    if gen.logprobs is not None:
        out["completion_probabilities"] = [_probs(model, ev, gen) for ev in s.logprobs]
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


async def _completion_stream(flight: Flight, gen: GenParams, model: ServerModel, return_tokens: bool):
    try:
        async for index, ev in flight:
            sample = flight.samples[index]
            if isinstance(ev, TokenEvent):
                chunk = {"index": index, "content": ev.text, "tokens": [ev.token] if return_tokens else [],
                         "stop": False, "id_slot": -1, "tokens_predicted": len(sample.tokens)}
                if gen.logprobs is not None:
                    chunk["completion_probabilities"] = [_probs(model, ev, gen)]
                yield event(chunk)
            elif ev.reason in ("error", "cancelled"):
                yield stream_failure(ev)
                return
            else:
                final = _result(sample, gen, model, return_tokens, flight.submitted)
                yield event({**final, "content": ev.text, "tokens": []})
    finally:
        flight.close()


# ---- tokens and templates ----

async def tokenize(request: Request) -> Response:
    model = request.app.state.ember.require_model()
    body = await read_body(request)
    content = body.str("content")
    if content is None:
        raise invalid("content", "content is required", "missing_field")
    ids = model.tokenizer.encode(content, add_special=body.bool("add_special", False),
                                 parse_special=body.bool("parse_special", True))
    if not body.bool("with_pieces", False):
        return JSONResponse({"tokens": ids})
    return JSONResponse({"tokens": [{"id": t, "piece": _piece(model, t)} for t in ids]})


def _piece(model: ServerModel, token: int):
    """A token's text, or its bytes when they are not valid UTF-8 on their own."""
    raw = token_piece(model, token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


async def detokenize(request: Request) -> Response:
    model = request.app.state.ember.require_model()
    body = await read_body(request)
    tokens = body.list("tokens", [])
    ids = []
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int):
            raise invalid(f"tokens[{i}]", f"tokens[{i}] must be a token id", "invalid_type")
        ids.append(check_token(model, t, f"tokens[{i}]"))
    return JSONResponse({"content": model.tokenizer.decode(ids)})


async def apply_template(request: Request) -> Response:
    model = request.app.state.ember.require_model()
    body = await read_body(request)
    messages = parse_messages(body)
    text = render_chat(model, messages, parse_tools(body), body.bool("add_generation_prompt", True),
                       template_kwargs(body))
    return JSONResponse({"prompt": text})


# ---- server state ----

async def props(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    model = state.require_model()
    defaults = parse_sampling(Fields({}), model)
    params = asdict(defaults)
    params["n_predict"] = -1
    tok = model.tokenizer
    return JSONResponse({
        "default_generation_settings": {"n_ctx": model.n_ctx, "params": params},
        "total_slots": model.engine.config.max_seqs, "model_path": str(model.path), "model_alias": model.id,
        "chat_template": model.template_text, "chat_template_source": model.chat_template.source,
        "chat_template_tools": "tagged" if model.native_tools else "generic",
        "bos_token": tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
        "eos_token": tok.token_text(tok.eos_id) if tok.eos_id is not None else "",
        "modalities": {"vision": False, "audio": False}, "build_info": f"ember {__version__}",
        "kv_cache": {"pages": model.engine.pool.n_pages, "page_size": model.engine.pool.page_size}})


async def slots(request: Request) -> Response:
    """One entry per slot: a running sequence or idle. Slots are not tied to a cache here."""
    model = request.app.state.ember.require_model()
    running = list(model.engine.scheduler.running)
    out = []
    for i in range(max(model.engine.config.max_seqs, len(running))):
        seq = running[i] if i < len(running) else None
        out.append({"id": i, "n_ctx": model.n_ctx, "is_processing": seq is not None,
                    "id_task": seq.id if seq else -1,
                    "n_prompt_tokens": seq.n_prompt if seq else 0,
                    "n_cached_tokens": seq.n_cache_hit if seq else 0,
                    "next_token": {"n_decoded": seq.n_generated if seq else 0,
                                   "n_remain": seq.max_new_tokens - seq.n_generated if seq else -1}})
    return JSONResponse(out)


async def slot_action(request: Request) -> Response:
    """POST /slots/{id}?action=erase drops cached prompts. The prefix cache is shared by all
    slots here, so erasing any slot empties it (entries in use by running sequences stay)."""
    model = request.app.state.ember.require_model()
    slot, action = request.path_params["id_slot"], request.query_params.get("action")
    if not 0 <= slot < model.engine.config.max_seqs:
        raise invalid("id_slot", f"no slot {slot} (this server has {model.engine.config.max_seqs})")
    if action != "erase":
        raise invalid("action", f"slot action {action!r} is not supported (only erase)", "unsupported")
    cached = model.engine.kv_usage().cached_tokens
    model.engine.clear_cache()
    return JSONResponse({"id_slot": slot, "n_erased": cached})
