"""What the server holds: its settings, the loaded model, and the requests in flight.

The model loads in a background thread after the server starts listening, so /health can
answer 503 while it loads. `ServerState` lives on the Starlette app (no module globals).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import hub
from ..engine import Engine, EngineConfig, RequestHandle
from .errors import not_ready

log = logging.getLogger("ember.server")

DEFAULT_MAX_BODY = 16 << 20  # bytes; a long agent conversation is well under this


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """How to load the model and size the engine (the `ember serve` model flags)."""

    model: str = hub.DEFAULT_MODEL  # path or known name
    device: str = "auto"
    threads: int | None = None
    ctx: int | None = None  # tokens per sequence (default: the model's, at most 4096)
    slots: int = 4  # sequences computed at once
    kv_memory: int | None = None  # KV cache budget in bytes (default: ctx * slots tokens)
    batch: int = 512  # tokens per engine step
    max_queue: int = 256  # requests waiting beyond which new ones get 503
    chat_template_file: str | None = None

    def __post_init__(self):
        for name in ("slots", "batch", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.ctx is not None and self.ctx < 16:
            raise ValueError(f"ctx must be at least 16 tokens, got {self.ctx}")
        if self.kv_memory is not None and self.kv_memory <= 0:
            raise ValueError(f"kv_memory must be a positive number of bytes, got {self.kv_memory}")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP layer's settings."""

    alias: str | None = None  # the model id clients see (default: the file name without .gguf)
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    cors_origins: tuple[str, ...] = ()  # empty: no CORS headers
    max_body_bytes: int = DEFAULT_MAX_BODY
    max_n: int = 16  # the most samples one request may ask for
    max_stop: int = 16  # the most stop strings
    shutdown_grace_s: float = 10.0  # streams may finish this long after SIGTERM, then are cancelled

    def __post_init__(self):
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if any(not k for k in self.api_keys):
            raise ValueError("an API key must not be empty")
        if self.max_n < 1 or self.shutdown_grace_s < 0:
            raise ValueError("max_n must be >= 1 and shutdown_grace_s >= 0")


@dataclass(slots=True)
class ServerModel:
    """A loaded model with everything the routes need."""

    path: Path
    model: object
    tokenizer: object
    chat_template: object  # ember.tokenizer.chat.ChatTemplate
    template_text: str  # the Jinja source, for /props and the tools check
    native_tools: bool  # the template renders `tools` itself
    engine: Engine
    n_ctx: int
    load_s: float
    gguf: object = None
    names: frozenset[str] = frozenset()  # model ids a request may name
    alias: str | None = None

    @property
    def id(self) -> str:
        """The model id clients see."""
        return self.alias or self.path.name.removesuffix(".gguf")

    def accepts(self, name: str | None) -> bool:
        return name is None or name in self.names

    def close(self) -> None:
        self.engine.close()
        if self.gguf is not None:
            self.gguf.close()


def load_model(cfg: ModelConfig, alias: str | None = None) -> ServerModel:
    """Open the GGUF file, build the model, tokenizer, chat template and engine."""
    from ..backends import get_backend
    from ..gguf_loader import GGUFFile
    from ..models import load_model as build_model
    from ..tokenizer import Tokenizer

    t0 = time.perf_counter()
    path = hub.resolve(cfg.model)
    gguf = GGUFFile(path)
    try:
        model = build_model(gguf, get_backend(cfg.device, threads=cfg.threads))
        tokenizer = Tokenizer.from_metadata(gguf.metadata)
        template, text = chat_template(gguf.metadata, cfg.chat_template_file)
        n_ctx = cfg.ctx or min(4096, model.n_ctx_train or 4096)
        engine = Engine(model, tokenizer, EngineConfig(
            n_ctx=n_ctx, max_seqs=cfg.slots, kv_tokens=kv_tokens(cfg.kv_memory, model, n_ctx),
            max_batch_tokens=cfg.batch, max_waiting=cfg.max_queue))
    except BaseException:
        gguf.close()
        raise
    names = {path.name, path.name.removesuffix(".gguf"), str(cfg.model), str(path)}
    names |= {alias} if alias else set()
    return ServerModel(path, model, tokenizer, template, text, mentions_tools(text), engine, n_ctx,
                       time.perf_counter() - t0, gguf, frozenset(names), alias)


def kv_bytes_per_token(model) -> int:
    """K and V of every layer in f16."""
    return sum(k + v for k, v in model.kv_dims()) * 2


def kv_tokens(kv_memory: int | None, model, n_ctx: int) -> int | None:
    """--kv-memory bytes -> KV cache capacity in tokens (None: the engine's default)."""
    if kv_memory is None:
        return None
    per_token = kv_bytes_per_token(model)
    tokens = kv_memory // per_token
    if tokens < n_ctx:
        raise ValueError(f"--kv-memory {kv_memory} bytes holds {tokens} tokens ({per_token} bytes each); "
                         f"one context of {n_ctx} tokens needs {n_ctx * per_token} bytes")
    return tokens


def chat_template(metadata: dict, override_file: str | None):
    """The ChatTemplate to use and its Jinja source text."""
    from ..tokenizer.chat import ChatTemplate, builtin_source

    base = ChatTemplate.from_metadata(metadata)
    if override_file:
        text = Path(override_file).read_text(encoding="utf-8")
        return ChatTemplate.from_string(text, f"file:{override_file}", base.bos_token, base.eos_token,
                                        base.add_bos, base.add_eos), text
    if base.source.startswith("builtin:"):
        return base, builtin_source(base.source.split(":", 1)[1])
    return base, metadata.get("tokenizer.chat_template", "")


def mentions_tools(template_text: str) -> bool:
    """Whether a Jinja template reads the `tools` variable (then it formats tools natively)."""
    import jinja2.meta

    from ..tokenizer.chat import environment

    try:
        return "tools" in jinja2.meta.find_undeclared_variables(environment().parse(template_text))
    except Exception:  # a template that does not parse fails later, when rendered
        return False


@dataclass(slots=True)
class HttpStats:
    """Counters the HTTP layer keeps (event-loop thread only)."""

    prompt_seconds: float = 0.0  # submission to first token, summed over finished samples
    predicted_seconds: float = 0.0  # first to last token, summed
    rejected_queue_full: int = 0
    requests: int = 0  # generation requests accepted


class ServerState:
    """The per-app state: settings, the model once loaded, and the engine requests in flight."""

    def __init__(self, config: ServerConfig, loader: Callable[[], ServerModel], close_model: bool = True,
                 on_load_failure: Callable[[], None] | None = None):
        self.config, self.loader, self.close_model = config, loader, close_model
        self.on_load_failure = on_load_failure
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the app starts
        self.model: ServerModel | None = None
        self.load_error: str | None = None
        self.draining = False
        self.active: set[RequestHandle] = set()
        self.stats = HttpStats()
        self.started = time.time()
        self.loaded = threading.Event()

    def start_loading(self) -> None:
        threading.Thread(target=self._load, name="ember-load", daemon=True).start()

    def _load(self) -> None:
        try:
            self.model = self.loader()
            log.info("model %s ready (%.2f s)", self.model.id, self.model.load_s)
        except Exception as e:
            self.load_error = f"{type(e).__name__}: {e}"
            log.error("loading the model failed: %s", self.load_error)
            if self.on_load_failure is not None:
                self.on_load_failure()
        finally:
            self.loaded.set()

    def require_model(self) -> ServerModel:
        """The model, or 503 while loading, after a failed load, or while shutting down."""
        if self.draining:
            raise not_ready("the server is shutting down")
        if self.model is None:
            raise not_ready(f"the model failed to load: {self.load_error}" if self.load_error else "Loading model")
        return self.model

    def begin_drain(self) -> None:
        """Stop admitting requests; cancel the running ones after the grace period (loop thread)."""
        if self.draining:
            return
        self.draining = True
        log.info("shutting down: %d request(s) running, %.0f s to finish", len(self.active),
                 self.config.shutdown_grace_s)
        if self.active:
            self.loop.call_later(self.config.shutdown_grace_s, self.cancel_all)

    def cancel_all(self) -> None:
        for handle in list(self.active):
            handle.cancel()

    def close(self) -> None:
        self.cancel_all()
        self.loaded.wait(timeout=60)
        if self.model is not None and self.close_model:
            self.model.close()

