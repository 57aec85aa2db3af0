"""Routes: /v1/embeddings (OpenAI), /embedding and /embeddings (llama-server), /v1/rerank, /rerank,
/reranking, /v1/reranking. Each reads its body, tokenizes its inputs, awaits the embedder (which
batches them with other requests' inputs) and writes the reply; off the event loop for a big body,
on it for a small one (one or a few texts: the thread-pool hops cost more than the work), and
likewise for the reply by the values it holds."""
from __future__ import annotations

import asyncio
from functools import partial

from starlette.concurrency import run_in_threadpool as off_loop
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...engine.embed import EmbeddingError, rank_ids
from ..errors import APIError, context_exceeded, invalid
from ..exchange import SMALL_BODY, parsed
from ..state import ServerModel, ServerState
from .reply import embedding_json, rerank_reply, truncated
from .request import EmbeddingRequest, RerankRequest, parse_embedding, parse_rerank

SMALL_REPLY = 4096  # float values a reply may write on the loop (~1.5 ms)


async def embeddings_openai(request: Request) -> Response:
    return await _embeddings(request, openai=True)


async def embeddings(request: Request) -> Response:
    return await _embeddings(request, openai=False)


async def _embeddings(request: Request, openai: bool) -> Response:
    state: ServerState = request.app.state.ember
    async with state.using_model() as model:
        embedder = require_embedder(model)
        raw = await request.body()
        small = len(raw) <= SMALL_BODY
        req = await here_or_off(small, parsed, raw, parse_embedding, (openai,))
        check_pooling(req, embedder)
        seqs = await here_or_off(small, tokenized, model, req)
        results = await run(partial(embedder.submit, seqs, normalize=req.normalize), req.param, embedder)
    small = sum(r.size for r in results) <= SMALL_REPLY
    body = await here_or_off(small, _reply, req, results, [len(s) for s in seqs], model.id)
    return Response(body, media_type="application/json")


async def here_or_off(small: bool, fn, *args):
    """fn(*args) on the event loop for a small request (a thread-pool hop costs more than reading,
    tokenizing or writing a few texts), else off it."""
    return fn(*args) if small else await off_loop(fn, *args)


def _reply(req: EmbeddingRequest, results: list, n_tokens: list[int], model_id: str) -> bytes:
    """The reply's JSON text (off the loop for a big request: a thousand vectors take a while to write)."""
    results = [truncated(r, req.dimensions) if r.ndim == 1 else r for r in results]
    return embedding_json(req, results, n_tokens, model_id)


async def rerank(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    async with state.using_model() as model:
        embedder = require_embedder(model)
        if embedder.pooling != "rank":
            raise APIError(501, "This server does not support reranking. Start it with --reranking",
                           type="not_supported_error", code="not_supported")
        raw = await request.body()
        small = len(raw) <= SMALL_BODY
        req = await here_or_off(small, parsed, raw, parse_rerank, ())
        seqs = await here_or_off(small, _rank_ids, model, req)
        scores = await run(partial(embedder.submit, seqs, rank=True), "documents", embedder)
    return JSONResponse(rerank_reply(req, scores, sum(len(s) for s in seqs), model.id))


def require_embedder(model: ServerModel):
    if model.embedder is None:
        raise APIError(501, "This server does not support embeddings. Start it with --embeddings",
                       type="not_supported_error", code="not_supported")
    return model.embedder


def check_pooling(req: EmbeddingRequest, embedder) -> None:
    if embedder.pooling == "rank":
        raise APIError(501, "This server is started for reranking (rank pooling); it does not give embeddings. "
                            "Use /v1/rerank, or start it with --embeddings", type="not_supported_error",
                       code="not_supported")
    if req.openai and embedder.pooling == "none":
        raise invalid("input", "pooling 'none' gives a vector per token, which OpenAI's reply cannot hold; "
                               "use /embedding, or start the server with another --pooling", "unsupported")
    if req.dimensions is not None and (embedder.pooling == "none" or req.dimensions > embedder.dim):
        raise invalid("dimensions", f"dimensions must be at most the model's {embedder.dim}"
                      if embedder.pooling != "none" else "dimensions needs pooled embeddings")


def tokenized(model: ServerModel, req: EmbeddingRequest) -> list[list[int]]:
    """Texts with their special tokens (as llama-server: added and parsed); ids as given."""
    tok = model.tokenizer
    return [tok.encode(x, add_special=True, parse_special=True) if isinstance(x, str) else x for x in req.inputs]


def _rank_ids(model: ServerModel, req: RerankRequest) -> list[list[int]]:
    return [rank_ids(model.tokenizer, model.gguf.metadata, req.query, d) for d in req.documents]


async def run(submit, param: str, embedder):
    """The results of submit() (the embedder's future); 400 for inputs it refuses (too long: the
    context error)."""
    try:
        return await asyncio.wrap_future(submit())
    except EmbeddingError as e:
        raise _refusal(e, param, embedder) from None


def _refusal(e: EmbeddingError, param: str, embedder) -> APIError:
    if e.n_tokens is not None:
        return context_exceeded(param, e.n_tokens, embedder.n_ctx)
    return invalid(param, str(e))
