"""Several models in one server (`ember serve --models-dir DIR`), as llama-server's router mode.

Each model is a whole ember app (create_app: its own engine, state and routes), started on first
use and stopped least-recently-used beyond `models_max` (or beyond `memory` bytes of model files). The router answers /v1/models (every
model with its status), /models/load, /models/unload and /health itself; any other request goes
to the app of the model its body's `model` field names (GET requests: the `model` query
parameter), with the body handed on unchanged. With one model, any name is that model. A model
that is loading holds its own requests only; the others go on being served.

The router checks hosts, origins and keys once (its Guard); the models' apps are built without
those checks and get requests without their Origin header.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from .errors import APIError, invalid, not_ready
from .guard import Guard, send_error
from .origins import LOOPBACK
from .state import ModelConfig, ServerConfig

log = logging.getLogger("ember.router")


@dataclass(eq=False)
class Entry:
    """One model of the router: where it is, and its app while loaded."""

    name: str
    path: Path
    app: object = None
    stack: AsyncExitStack | None = None
    status: str = "unloaded"  # unloaded, loading, loaded, failed
    error: str | None = None
    active: int = 0  # requests in flight
    last_used: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def models_in(directory: Path) -> dict[str, Path]:
    """The GGUF files of a folder by name (the file name without .gguf), sorted."""
    if not directory.is_dir():
        raise ValueError(f"--models-dir {directory} is not a folder")
    found = {p.name.removesuffix(".gguf"): p for p in sorted(directory.glob("*.gguf")) if p.is_file()}
    if not found:
        raise ValueError(f"--models-dir {directory} holds no .gguf file")
    return found


class Router:
    def __init__(self, models: dict[str, Path], model_cfg: ModelConfig, config: ServerConfig, models_max: int = 1,
                 memory: int | None = None):
        """memory: a budget in bytes for the loaded models' files (the weights' share of memory;
        None: no budget, only models_max)."""
        if models_max < 1 or (memory is not None and memory <= 0):
            raise ValueError(f"models_max must be at least 1 and memory positive, got {models_max} and {memory}")
        self.entries = {name: Entry(name, path) for name, path in models.items()}
        self.model_cfg, self.config, self.models_max, self.memory = model_cfg, config, models_max, memory
        # each model's app: the router's settings without its guard (checked once, by the router)
        self.app_config = replace(config, api_keys=(), allowed_hosts=("*",), cors_origins=())

    # ---- choosing ----
    def entry(self, name: str | None) -> Entry:
        if len(self.entries) == 1:
            return next(iter(self.entries.values()))
        if name is None:
            raise invalid("model", f"model is required: this server has {len(self.entries)} models "
                                   f"({', '.join(self.entries)})", "missing_field")
        found = self.entries.get(name)
        if found is None:
            raise APIError(404, f"no model named {name!r} here (have: {', '.join(self.entries)})", param="model",
                           code="model_not_found")
        return found

    # ---- loading and unloading ----
    async def load(self, e: Entry):
        """The model's app, started (and the model loaded) if it is not; others beyond models_max
        are stopped first, least recently used first."""
        async with e.lock:
            if e.status == "loaded":
                return e.app
            await self._make_room(e)
            from ..app import create_app
            from .state import load_model

            cfg = replace(self.model_cfg, model=str(e.path), speculative=self._speculative_for(e))
            app = create_app(replace(self.app_config, aliases=(e.name,)), lambda: load_model(cfg, (e.name,)))
            e.status, e.stack, t0 = "loading", AsyncExitStack(), time.perf_counter()
            await e.stack.enter_async_context(app.router.lifespan_context(app))
            state = app.state.ember
            await asyncio.to_thread(state.loaded.wait)
            if state.model is None:
                e.status, e.error = "failed", state.load_error
                await self._stop(e)
                raise not_ready(f"model {e.name!r} failed to load: {state.load_error}")
            e.app, e.status, e.error = app, "loaded", None
            log.info("model %s loaded in %.2f s", e.name, time.perf_counter() - t0)
            return app

    def _speculative_for(self, e: Entry):
        """The speculative settings for model e: the server's, less the draft model where its
        vocabulary is not e's (one --model-draft serves the models it fits; the others load
        without it rather than fail)."""
        spec = self.model_cfg.speculative
        if spec.model is None:
            return spec
        from ..engine.draftmodel import check_vocab
        from ..models import ModelError
        from ..gguf_loader import GGUFFile

        try:
            with GGUFFile(e.path) as target, GGUFFile(spec.model.path) as draft:
                a, b = target.metadata, draft.metadata
                check_vocab(a, b, len(a.get("tokenizer.ggml.tokens") or ()), len(b.get("tokenizer.ggml.tokens") or ()))
        except ModelError as err:
            log.warning("model %s loads without the draft model: %s", e.name, err)
            return replace(spec, types=tuple(t for t in spec.types if t != "draft"), model=None)
        return spec

    async def _make_room(self, coming: Entry) -> None:
        loaded = sorted((e for e in self.entries.values() if e.status == "loaded" and e is not coming),
                        key=lambda e: (e.active > 0, e.last_used))  # idle ones first, then the oldest
        while loaded and (len(loaded) + 1 > self.models_max or self._over_budget(loaded, coming)):
            await self.unload(loaded.pop(0))

    def _over_budget(self, loaded: list[Entry], coming: Entry) -> bool:
        if self.memory is None:
            return False
        return sum(e.path.stat().st_size for e in [*loaded, coming]) > self.memory

    async def unload(self, e: Entry) -> None:
        """Stop the model's app (its running requests are cancelled) and free the model."""
        if e.status == "loaded":
            log.info("unloading model %s", e.name)
            await self._stop(e)
            e.status = "unloaded"

    @staticmethod
    async def _stop(e: Entry) -> None:
        stack, e.stack, e.app = e.stack, None, None
        if stack is not None:
            await stack.aclose()

    async def close(self) -> None:
        for e in self.entries.values():
            await self._stop(e)

    # ---- forwarding ----
    async def forward(self, scope, receive, send) -> None:
        body = await _whole_body(receive)
        try:
            e = self.entry(_model_name(scope, body))
            app = await self.load(e)
        except APIError as err:
            return await send_error(send, err)
        e.active += 1
        e.last_used = time.monotonic()
        headers = [(k, v) for k, v in scope["headers"] if k != b"origin"]
        try:
            await app({**scope, "headers": headers}, _replay(body, receive), send)
        finally:
            e.active -= 1
            e.last_used = time.monotonic()

    def describe(self, e: Entry) -> dict:
        status = {"value": e.status, **({"error": e.error} if e.error else {})}
        return {"id": e.name, "object": "model", "owned_by": "ember", "created": 0, "path": str(e.path),
                "status": status}


async def _whole_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _model_name(scope, body: bytes) -> str | None:
    if scope["method"] == "GET":
        query = dict(p.split("=", 1) for p in scope.get("query_string", b"").decode().split("&") if "=" in p)
        return query.get("model")
    try:
        value = json.loads(body) if body.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # the model's app answers the bad body
    name = value.get("model") if isinstance(value, dict) else None
    return name if isinstance(name, str) else None


def create_router_app(router: Router) -> Starlette:
    """The router as an app: its own routes, then every other path forwarded to a model."""
    from ..app import _api_error, _http_error, _internal_error

    async def list_models(request: Request):
        return JSONResponse({"object": "list", "data": [router.describe(e) for e in router.entries.values()]})

    async def load(request: Request):
        e = router.entry(await _named(request))
        await router.load(e)
        return JSONResponse({"success": True, "model": router.describe(e)})

    async def unload(request: Request):
        e = router.entry(await _named(request))
        await router.unload(e)
        return JSONResponse({"success": True, "model": router.describe(e)})

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    @asynccontextmanager
    async def lifespan(app):
        yield
        await router.close()

    from ..app import page_routes

    config = router.config
    own = [Route("/v1/models", list_models, methods=["GET"]), Route("/models", list_models, methods=["GET"]),
           Route("/models/load", load, methods=["POST"]), Route("/models/unload", unload, methods=["POST"]),
           Route("/health", health, methods=["GET"]), Route("/v1/health", health, methods=["GET"])]
    routes = (page_routes() if config.webui else []) + own + [Mount("/", app=router.forward)]
    middleware = [Middleware(Guard, api_keys=config.api_keys, max_body_bytes=config.max_body_bytes,
                             allowed_hosts=config.allowed_hosts or (LOOPBACK,), cors_origins=config.cors_origins)]
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan, exception_handlers={
        APIError: _api_error, HTTPException: _http_error, Exception: _internal_error})
    app.state.router = router
    return app


async def _named(request: Request) -> str | None:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the request body must be a JSON object with `model`", code="invalid_json") from None
    name = body.get("model") if isinstance(body, dict) else None
    if not isinstance(name, str):
        raise invalid("model", "model is required (a name from /v1/models)", "missing_field")
    return name
