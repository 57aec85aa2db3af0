"""llama-server's own routes, with its field names: /completion (also /completions), /tokenize,
/detokenize, /apply-template, /health, /props, /slots. The ones that generate read their body
into a typed request, run its `Generation` in the core and write the run back in llama-server's
shapes; the others answer from the model and the server's state."""
from __future__ import annotations

from starlette.concurrency import run_in_threadpool as off_loop
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ... import __version__
from ..core.request import Limits
from ..core.run import start
from ..core.tools import format_of
from ..errors import invalid
from ..exchange import json_reply, read, respond
from ..openai.messages import chat
from ..state import ServerState
from .infill import infill_ids, parse_infill, with_prompt
from .reply import CompletionReply, detokenized, generation_settings, templated, tokenized
from .request import parse_completion, parse_detokenize, parse_tokenize
from .slotsave import slot_file


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


async def completion(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    async with state.using_model() as model:
        completion = await read(request, parse_completion, Limits.of(state.config, model))
        run = await start(state, model, completion.gen, request)
    return await respond(request, run, CompletionReply(completion, model))


async def infill(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    async with state.using_model() as model:
        req = await read(request, parse_infill, Limits.of(state.config, model))
        n_predict = state.config.n_predict
        ids = await off_loop(infill_ids, model.tokenizer, req, model.n_ctx, n_predict)
        completion = with_prompt(req, ids)
        run = await start(state, model, completion.gen, request)
    return await respond(request, run, CompletionReply(completion, model))


# ---- tokens and templates ----

async def tokenize(request: Request) -> Response:
    async with request.app.state.ember.using_model() as model:
        req = await read(request, parse_tokenize)
        return await json_reply(tokenized, req, model)


async def detokenize(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    async with state.using_model() as model:
        ids = await read(request, parse_detokenize, Limits.of(state.config, model))
        return await json_reply(detokenized, ids, model)


async def apply_template(request: Request) -> Response:
    async with request.app.state.ember.using_model() as model:
        conversation = await read(request, chat)
        return await json_reply(templated, conversation, model)


# ---- server state ----

async def props(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    info = state.require_info()
    settings = generation_settings(state.config.sampling_defaults(), state.config.n_predict)
    return JSONResponse({
        "default_generation_settings": {"n_ctx": info.n_ctx, "params": settings},
        "total_slots": info.slots, "model_path": str(info.path), "model_alias": info.id,
        "chat_template": info.template_text, "chat_template_source": info.template_source,
        "chat_template_tools": "tagged" if info.native_tools else "generic",
        "chat_format": format_of(info.template_text, info.native_tools).name,
        "bos_token": info.bos_token, "eos_token": info.eos_token,
        "modalities": {"vision": False, "audio": False}, "build_info": f"ember {__version__}",
        "is_sleeping": state.sleeping, "kv_cache": {"pages": info.kv_pages, "page_size": info.page_size}})


async def slots(request: Request) -> Response:
    """One entry per slot: a running sequence or idle. Slots are not tied to a cache here."""
    state: ServerState = request.app.state.ember
    info = state.require_info()
    model = state.model
    running = list(model.engine.scheduler.running) if model is not None and model.engine is not None else []
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
    slots here, so erasing any slot empties it (entries in use by running sequences stay).
    action=save|restore with {"filename": NAME} writes a slot's cached tokens and KV pages to
    --slot-save-path/NAME, or loads such a file into the cache (slotsave.py)."""
    state: ServerState = request.app.state.ember
    info = state.require_info()
    slot, action = request.path_params["id_slot"], request.query_params.get("action")
    if not 0 <= slot < info.slots:
        raise invalid("id_slot", f"no slot {slot} (this server has {info.slots})")
    if action in ("save", "restore"):
        return await slot_file(request, state, slot, action)
    if action != "erase":
        raise invalid("action", f"slot action {action!r} is not supported (erase, save, restore)", "unsupported")
    if state.sleeping:  # the cache went with the model
        return JSONResponse({"id_slot": slot, "n_erased": 0})
    model = state.require_model()
    if model.engine is None:
        return JSONResponse({"id_slot": slot, "n_erased": 0})
    cached = model.engine.kv_usage().cached_tokens
    model.engine.clear_cache()
    return JSONResponse({"id_slot": slot, "n_erased": cached})
