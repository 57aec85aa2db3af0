"""Anthropic's routes: /v1/messages and /v1/messages/count_tokens."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from ..core.prompts import chat_prompt
from ..core.request import Limits
from ..core.run import start
from ..exchange import json_reply, read, respond
from ..fields import Fields
from ..openai.messages import chat
from ..state import ServerModel, ServerState
from .reply import MessagesReply
from .request import openai_chat, parse_messages


async def messages(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    async with state.using_model() as model:
        req = await read(request, parse_messages, Limits.of(state.config, model))
        run = await start(state, model, req.gen, request)
    return await respond(request, run, MessagesReply(req, model))


async def count_tokens(request: Request) -> Response:
    async with request.app.state.ember.using_model() as model:
        conversation = await read(request, lambda body: chat(Fields(openai_chat(body))))
        return await json_reply(_counted, model, conversation)


def _counted(model: ServerModel, conversation) -> dict:
    return {"input_tokens": len(chat_prompt(model, conversation).ids)}
