"""The Responses routes: POST /v1/responses, and GET and DELETE /v1/responses/{id} of kept ones."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..core.request import Limits
from ..core.run import start
from ..exchange import read, respond
from ..state import ServerState
from .reply import ResponsesReply
from .request import not_kept, parse_responses


async def responses(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    store = request.app.state.responses
    async with state.using_model() as model:
        req = await read(request, parse_responses, Limits.of(state.config, model), store)
        run = await start(state, model, req.gen, request)
    return await respond(request, run, ResponsesReply(req, model, store))


async def retrieve(request: Request) -> Response:
    kept = request.app.state.responses.get(request.path_params["response_id"])
    if kept is None:
        raise not_kept(request.path_params["response_id"], None)
    return JSONResponse(kept[1])


async def delete(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not request.app.state.responses.delete(response_id):
        raise not_kept(response_id, None)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
