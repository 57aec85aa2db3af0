"""OpenAI's routes: /v1/models, /v1/chat/completions, /v1/completions. Each reads its body into
its typed request, runs the request's `Generation` in the core, and writes the run back in
OpenAI's shapes."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..core.request import Limits
from ..core.run import start
from ..exchange import read, respond
from ..state import ServerState
from .reply import ChatReply, CompletionReply, models_reply
from .request import parse_chat, parse_completion


async def list_models(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    return JSONResponse(models_reply(state.require_info(), state))


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    async with state.using_model() as model:
        chat = await read(request, parse_chat, Limits.of(state.config, model))
        run = await start(state, model, chat.gen, request)
    return await respond(request, run, ChatReply(chat, model))


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    async with state.using_model() as model:
        completion = await read(request, parse_completion, Limits.of(state.config, model))
        run = await start(state, model, completion.gen, request)
    return await respond(request, run, CompletionReply(completion, model))
