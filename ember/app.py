"""The HTTP server: an OpenAI- and llama-server-compatible API over one engine.

    app = create_app(ServerConfig(), lambda: load_model(ModelConfig("smollm2")))
    serve(ModelConfig("smollm2"), ServerConfig(), host="127.0.0.1", port=8080)

Routes live in ember/server (openai/, llamacpp/, metrics.py); this module wires them
with the middleware (Host and Origin checks, CORS, API keys, body limit), the error handlers,
the lifespan (loading the model, putting it to sleep when idle) and uvicorn's configuration:
connection deadlines and the graceful shutdown.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Callable

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .server.connection import TimedProtocol
from .server.anthropic import routes as anthropic
from .server import webui
from .server.embeddings import routes as embeddings
from .server.errors import APIError, server_error
from .server.guard import Guard
from .server.llamacpp import routes as llamacpp
from .server.metrics import make_registry, metrics
from .server.openai import routes as openai
from .server.responses import routes as responses
from .server.responses.store import ResponseStore
from .server.origins import ANY, LOOPBACK, is_loopback_bind
from .server.state import ModelConfig, ServerConfig, ServerModel, ServerState, load_model

__all__ = ["ModelConfig", "ServerConfig", "create_app", "load_model", "serve", "serve_router", "uvicorn_config"]


def page_routes() -> list[Route]:
    """The chat page (--no-webui leaves it out)."""
    return [Route("/", webui.index, methods=["GET"]), Route("/webui/{name}", webui.static, methods=["GET"])]


def routes() -> list[Route]:
    post, get = ["POST"], ["GET"]
    table = [
        ("/v1/models", openai.list_models, get), ("/models", openai.list_models, get),
        ("/v1/chat/completions", openai.chat_completions, post), ("/chat/completions", openai.chat_completions, post),
        ("/v1/completions", openai.completions, post),
        ("/v1/responses", responses.responses, post), ("/responses", responses.responses, post),
        ("/v1/responses/{response_id}", responses.retrieve, get),
        ("/v1/responses/{response_id}", responses.delete, ["DELETE"]),
        ("/v1/messages", anthropic.messages, post), ("/v1/messages/count_tokens", anthropic.count_tokens, post),
        ("/completion", llamacpp.completion, post), ("/completions", llamacpp.completion, post),
        ("/infill", llamacpp.infill, post),
        ("/tokenize", llamacpp.tokenize, post), ("/detokenize", llamacpp.detokenize, post),
        ("/apply-template", llamacpp.apply_template, post),
        ("/health", llamacpp.health, get), ("/v1/health", llamacpp.health, get),
        ("/props", llamacpp.props, get), ("/slots", llamacpp.slots, get),
        ("/slots/{id_slot:int}", llamacpp.slot_action, post),
        ("/metrics", metrics, get),
        ("/v1/embeddings", embeddings.embeddings_openai, post), ("/embeddings", embeddings.embeddings, post),
        ("/embedding", embeddings.embeddings, post),
        *((path, embeddings.rerank, post) for path in ("/v1/rerank", "/rerank", "/reranking", "/v1/reranking")),
    ]
    return [Route(path, endpoint, methods=methods) for path, endpoint, methods in table]


def create_app(config: ServerConfig, loader: Callable[[], ServerModel], close_model: bool = True,
               on_load_failure: Callable[[], None] | None = None) -> Starlette:
    """The Starlette app. `loader` runs in a thread once the server is up (/health says 503
    until it returns); `close_model`: close the engine when the app shuts down."""
    state = ServerState(config, loader, close_model, on_load_failure)

    @asynccontextmanager
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        state.start_loading()
        watch = asyncio.ensure_future(state.watch_idle()) if config.sleep_idle_s else None
        yield
        if watch is not None:
            watch.cancel()
        await run_in_threadpool(state.close)

    middleware = [Middleware(Guard, api_keys=config.api_keys, max_body_bytes=config.max_body_bytes,
                             allowed_hosts=config.allowed_hosts or (LOOPBACK,), cors_origins=config.cors_origins)]
    app = Starlette(routes=routes() + (page_routes() if config.webui else []), middleware=middleware, lifespan=lifespan, exception_handlers={
        APIError: _api_error, HTTPException: _http_error, ClientDisconnect: _client_gone,
        Exception: _internal_error})
    app.state.ember = state
    app.state.responses = ResponseStore()  # kept for previous_response_id
    app.state.registry = make_registry(state)
    return app


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    codes = {404: "not_found", 405: "method_not_allowed"}
    message = {404: f"no route {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    err = APIError(exc.status_code, message, code=codes.get(exc.status_code))
    return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)


async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
    """The client left before its body arrived (or its body was late): nothing to log, no one to answer."""
    return Response(status_code=499)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug: the client gets a plain 500 body; uvicorn logs the traceback (Starlette re-raises)."""
    err = server_error(f"internal error ({type(exc).__name__}); the server log has the details")
    return JSONResponse(err.body(), status_code=500)


def serve(model_cfg: ModelConfig, config: ServerConfig, host: str = "127.0.0.1", port: int = 8080,
          log_level: str = "info", access_log: bool = False) -> int:
    """Run the server until SIGTERM/SIGINT; 0 after a clean shutdown, 1 if the model failed to load."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    server: GracefulServer | None = None

    def stop():
        server.should_exit = True

    config = for_address(config, host)
    app = create_app(config, lambda: load_model(model_cfg), on_load_failure=stop)
    server = GracefulServer(uvicorn_config(app, config, host=host, port=port, log_level=log_level,
                                           access_log=access_log), app.state.ember)
    server.run()
    return 1 if app.state.ember.load_error else 0


def serve_router(models: dict, model_cfg: ModelConfig, config: ServerConfig, models_max: int = 1,
                 host: str = "127.0.0.1", port: int = 8080, log_level: str = "info", access_log: bool = False,
                 models_memory: int | None = None) -> int:
    """Serve several models (name -> GGUF path), loaded on demand, at most `models_max` at once
    (server/router.py). Stops at SIGTERM/SIGINT, closing every loaded model."""
    from .server.router import Router, create_router_app

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    config = for_address(config, host)
    app = create_router_app(Router(models, model_cfg, config, models_max, models_memory))
    uvicorn.Server(uvicorn_config(app, config, host=host, port=port, log_level=log_level,
                                  access_log=access_log)).run()
    return 0


def for_address(config: ServerConfig, host: str) -> ServerConfig:
    """The Host values served, where not given: loopback names on a loopback address (a guard
    against DNS rebinding), any elsewhere (the server is meant to be reached by other names)."""
    if config.allowed_hosts is not None:
        return config
    return replace(config, allowed_hosts=(LOOPBACK,) if is_loopback_bind(host) else (ANY,))


def uvicorn_config(app, config: ServerConfig, **options) -> uvicorn.Config:
    """uvicorn's settings for ember: HTTP/1.1 with header and body deadlines (connection.py)."""
    return uvicorn.Config(app, http=TimedProtocol.with_timeouts(config.header_timeout_s, config.body_timeout_s),
                          lifespan="on", timeout_graceful_shutdown=5, **options)


class GracefulServer(uvicorn.Server):
    """uvicorn's server with ember's shutdown: the first SIGTERM/SIGINT stops admitting
    requests, which get 503 while the server keeps listening; running streams may finish for
    shutdown_grace_s, then are cancelled. Once none is left (or shortly after the grace period
    in any case) uvicorn closes the listening socket and the connections, and the lifespan
    closes the engine. A second signal forces the exit. The signal is not re-raised afterwards,
    so the exit status is 0."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.drain_deadline: float | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.drain_deadline is not None:  # the second signal
            self.should_exit = self.force_exit = True
        elif self.state.loop is None:  # not serving yet
            self.should_exit = True
        else:
            self.drain_deadline = time.monotonic() + self.state.config.shutdown_grace_s + 2
            self.state.loop.call_soon_threadsafe(self.state.begin_drain)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and (self.state.drained or time.monotonic() > self.drain_deadline):
            self.should_exit = True
        return await super().on_tick(counter)
