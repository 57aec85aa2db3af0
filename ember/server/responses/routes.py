"""The Responses route: POST /v1/responses."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from ..core.request import Limits
from ..core.run import start
from ..exchange import read, respond
from ..state import ServerState
from .reply import ResponsesReply
from .request import parse_responses


async def responses(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    store = request.app.state.responses
    async with state.using_model() as model:
        req = await read(request, parse_responses, Limits.of(state.config, model), store)
        run = await start(state, model, req.gen, request)
    return await respond(request, run, ResponsesReply(req, model, store))
