"""What the server holds: its settings, the loaded model, and the requests in flight.

The model loads in a background thread after the server starts listening, so /health can
answer 503 while it loads. `ServerState` lives on the Starlette app (no module globals).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from .. import hub
from ..engine import LLM, Engine, RequestHandle
from ..engine.speculate import SpecConfig
from ..sampler import SamplingParams
from .errors import not_ready
from .tokenfloor import TokenFloor

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
    # embeddings mode (llama-server's --embeddings / --reranking): the model gives embeddings or
    # rerank scores, no completions; pooling None: the file's (see engine/embed.py)
    embeddings: bool = False
    reranking: bool = False
    pooling: str | None = None
    embd_normalize: int = 2
    cache_type_k: str = "f16"  # the KV cache's storage types (f16, bf16, q8_0, q4_0)
    cache_type_v: str = "f16"
    cache_ram: int = 0  # bytes of host memory for pages evicted from the KV pool
    cache_disk: str | None = None  # folder of page files below that (kept across restarts)
    cache_disk_size: int = 0
    hash_file: bool = False  # identify the model by its file's hash (saved slots carry it)
    speculative: SpecConfig = SpecConfig()  # draft sources and limits (--spec-type, --draft-max, ...)

    def __post_init__(self):
        if self.reranking and self.pooling not in (None, "rank"):
            raise ValueError(f"reranking uses rank pooling, not {self.pooling}")
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

    aliases: tuple[str, ...] = ()  # names of the model; the first is its id (default: the file name without .gguf)
    tags: tuple[str, ...] = ()  # informational, listed by /v1/models
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    cors_origins: tuple[str, ...] = ("localhost",)  # browser origins served (see origins.py); "*": any
    # Host header values served (see origins.py); "*": any. None: loopback names when listening on a
    # loopback address, any otherwise (serve() decides; an app without a listener takes loopback names)
    allowed_hosts: tuple[str, ...] | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY
    max_sequences: int = 16  # prompts x n one request may ask for
    max_stop: int = 16  # the most stop strings
    shutdown_grace_s: float = 10.0  # streams may finish this long after SIGTERM, then are cancelled
    header_timeout_s: float = 10.0  # a connection's request line and headers must arrive within this
    body_timeout_s: float = 60.0  # and its body within this once the headers are in
    sleep_idle_s: float | None = None  # unload the model after this long without requests
    sampling: tuple[tuple[str, Any], ...] = ()  # server-wide sampling defaults, llama-server's field names
    n_predict: int = -1  # default token limit of a request; -1: until the context is full
    webui: bool = True  # the chat page at /
    slot_save_path: str | None = None  # folder of POST /slots/{id}?action=save|restore files
    kv_events_endpoint: str | None = None  # ZeroMQ address to publish KV events on (kv_events.py)
    kv_events_topic: str = ""

    def __post_init__(self):
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if any(not k for k in self.api_keys):
            raise ValueError("an API key must not be empty")
        if self.max_sequences < 1 or self.shutdown_grace_s < 0 or self.n_predict < -1:
            raise ValueError("max_sequences must be >= 1, shutdown_grace_s >= 0 and n_predict >= -1")
        if min(self.header_timeout_s, self.body_timeout_s, self.sleep_idle_s or 1) <= 0:
            raise ValueError("timeouts and the idle time before sleeping must be positive")
        SamplingParams.from_dict(dict(self.sampling))  # ValueError naming the field

    def sampling_defaults(self) -> SamplingParams:
        return SamplingParams.from_dict(dict(self.sampling))


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What describes the loaded model (/props, /v1/models); kept while the model sleeps."""

    id: str
    aliases: tuple[str, ...]
    path: Path
    size: int
    n_vocab: int
    n_ctx_train: int
    n_ctx: int
    slots: int
    kv_pages: int
    page_size: int
    template_text: str
    template_source: str
    native_tools: bool
    bos_token: str
    eos_token: str


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
    aliases: tuple[str, ...] = ()
    floor: TokenFloor | None = None  # a cheap lower bound on a text's token count
    embedder: object = None  # embeddings mode: the engine.embed.Embedder (and engine is None)

    @property
    def id(self) -> str:
        """The model id clients see."""
        return self.aliases[0] if self.aliases else self.path.name.removesuffix(".gguf")

    def describe(self) -> ModelInfo:
        tok, engine = self.tokenizer, self.engine
        slots, pages, page_size = (engine.config.max_seqs, engine.pool.n_pages, engine.pool.page_size) if engine \
            else (self.embedder.config.max_seqs, self.embedder.cache.n_pages, self.embedder.cache.page_size)
        return ModelInfo(
            self.id, self.aliases or (self.id,), self.path, self.path.stat().st_size, self.model.n_vocab,
            self.model.n_ctx_train, self.n_ctx, slots, pages, page_size, self.template_text, self.chat_template.source, self.native_tools,
            tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
            tok.token_text(tok.eos_id) if tok.eos_id is not None else "")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.embedder is not None:
            self.embedder.close()
        if self.gguf is not None:
            self.gguf.close()


def load_model(cfg: ModelConfig, aliases: tuple[str, ...] = ()) -> ServerModel:
    """The model as ember.load() opens it, with its chat template. (The names the model goes
    by are the server's: ServerConfig.aliases replaces `aliases`.)"""
    if cfg.embeddings or cfg.reranking:
        return load_embedding_model(cfg, aliases)
    t0 = time.perf_counter()
    llm = LLM(cfg.model, device=cfg.device, threads=cfg.threads, ctx=cfg.ctx, slots=cfg.slots, batch=cfg.batch,
              kv_memory=cfg.kv_memory, max_waiting=cfg.max_queue, cache_type_k=cfg.cache_type_k,
              cache_type_v=cfg.cache_type_v, cache_ram=cfg.cache_ram, cache_disk=cfg.cache_disk,
              cache_disk_size=cfg.cache_disk_size, hash_file=cfg.hash_file, speculative=cfg.speculative)
    try:
        template, text = chat_template(llm.gguf.metadata, cfg.chat_template_file)
    except BaseException:
        llm.close()
        raise
    return ServerModel(llm.path, llm.model, llm.tokenizer, template, text, mentions_tools(text), llm.engine, llm.n_ctx,
                       time.perf_counter() - t0, llm.gguf, tuple(aliases), TokenFloor.of(llm.tokenizer))


def load_embedding_model(cfg: ModelConfig, aliases: tuple[str, ...] = ()) -> ServerModel:
    """The model opened for embeddings or reranking only (no generation engine)."""
    from ..engine.embed import Embeddings

    t0 = time.perf_counter()
    pooling = "rank" if cfg.reranking else cfg.pooling
    e = Embeddings(cfg.model, device=cfg.device, threads=cfg.threads, pooling=pooling, normalize=cfg.embd_normalize,
                   max_batch_tokens=max(cfg.batch, 2048), **({"n_ctx": cfg.ctx} if cfg.ctx else {}))
    try:
        template, text = chat_template(e.gguf.metadata, cfg.chat_template_file)
    except BaseException:
        e.close()
        raise
    return ServerModel(e.path, e.model, e.tokenizer, template, text, False, None, e.embedder.n_ctx,
                       time.perf_counter() - t0, e.gguf, tuple(aliases), TokenFloor.of(e.tokenizer), e.embedder)


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
    n_tokens_max: int = 0  # longest sequence seen (prompt + generated)


class ServerState:
    """The per-app state: settings, the model once loaded, and the engine requests in flight.

    With sleep_idle_s the model is closed after that long without work (`sleeping`) and loaded
    again by the next request that needs it; what describes it (`info`) and the engine's
    counters outlive the sleep."""

    def __init__(self, config: ServerConfig, loader: Callable[[], ServerModel], close_model: bool = True,
                 on_load_failure: Callable[[], None] | None = None):
        self.config, self.loader, self.close_model = config, loader, close_model
        self.on_load_failure = on_load_failure
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the app starts
        self.model: ServerModel | None = None
        self.info: ModelInfo | None = None
        self.load_error: str | None = None
        self.draining = False
        self.sleeping = False
        self.active: set[RequestHandle] = set()
        self.preparing = 0  # requests between admission and their engine requests
        self.last_used = time.monotonic()
        self.stats = HttpStats()
        self.started = time.time()
        self.loaded = threading.Event()
        self._waking: asyncio.Future | None = None
        self._engine_metrics = None  # the engine's counters, carried across sleeps
        self.kv_events = _kv_publisher(config)

    # ---- loading ----

    def start_loading(self) -> None:
        threading.Thread(target=self._load, name="ember-load", daemon=True).start()

    def _load(self) -> None:
        try:
            self._loaded(self.loader())
            log.info("model %s ready (%.2f s)", self.model.id, self.model.load_s)
        except Exception as e:
            self.load_error = f"{type(e).__name__}: {e}"
            log.error("loading the model failed: %s", self.load_error)
            if self.on_load_failure is not None:
                self.on_load_failure()
        finally:
            self.loaded.set()

    def _loaded(self, model: ServerModel) -> None:
        if self.config.aliases and model.aliases != self.config.aliases:  # a view with the names clients see
            model = replace(model, aliases=self.config.aliases)
        if self._engine_metrics is not None and model.engine is not None:
            model.engine.metrics = self._engine_metrics
        if self.kv_events is not None:
            self.kv_events.attach(model.engine.tree)
        self.info, self.model = model.describe(), model

    def require_model(self) -> ServerModel:
        """The model, or 503 while loading, after a failed load, while asleep or shutting down."""
        if self.draining:
            raise not_ready("the server is shutting down")
        if self.model is None:
            raise not_ready(f"the model failed to load: {self.load_error}" if self.load_error else "Loading model")
        return self.model

    def require_info(self) -> ModelInfo:
        if self.info is None:
            self.require_model()
        return self.info

    @asynccontextmanager
    async def using_model(self):
        """The model for a request that uses it (woken first if it sleeps), counted as work in
        progress until the request's engine requests are in `active`."""
        self.preparing += 1
        try:
            yield await self.model_for_request()
        finally:
            self.preparing -= 1
            self.last_used = time.monotonic()

    async def model_for_request(self) -> ServerModel:
        """The model for a request that uses it, woken first if it sleeps."""
        self.last_used = time.monotonic()
        if self.sleeping and not self.draining:
            if self._waking is None:
                self._waking = asyncio.ensure_future(self._wake())
            await asyncio.shield(self._waking)
        return self.require_model()

    async def _wake(self) -> None:
        log.info("waking up: loading the model again")
        try:
            self._loaded(await asyncio.to_thread(self.loader))
            self.sleeping = False
        except Exception as e:  # still asleep: the next request tries again
            self.load_error = f"{type(e).__name__}: {e}"
            log.error("loading the model failed: %s", self.load_error)
        finally:
            self._waking = None

    # ---- sleeping ----

    def engine_metrics(self):
        """The engine's counters, also while the model sleeps."""
        return self.model.engine.metrics if self.model is not None and self.model.engine is not None \
            else self._engine_metrics

    @property
    def idle(self) -> bool:
        return not self.active and not self.preparing

    async def watch_idle(self) -> None:
        """Put the model to sleep after sleep_idle_s without work (a task of the app's lifetime)."""
        limit = self.config.sleep_idle_s
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            if not self.idle:
                self.last_used = time.monotonic()
            elif self.model is not None and not self.draining and time.monotonic() - self.last_used >= limit:
                await self._sleep()

    async def _sleep(self) -> None:
        model, self.model, self.sleeping = self.model, None, True
        self._engine_metrics = model.engine.metrics if model.engine is not None else None
        log.info("no requests for %.0f s: unloading the model until the next one", self.config.sleep_idle_s)
        if self.close_model:
            await asyncio.to_thread(model.close)
        if self.kv_events is not None:
            self.kv_events.detach(model.engine.tree)

    # ---- shutting down ----

    def begin_drain(self) -> None:
        """Stop admitting requests; cancel the running ones after the grace period (loop thread)."""
        if self.draining:
            return
        self.draining = True
        log.info("shutting down: %d request(s) running, %.0f s to finish", len(self.active),
                 self.config.shutdown_grace_s)
        if self.active:
            self.loop.call_later(self.config.shutdown_grace_s, self.cancel_all)

    @property
    def drained(self) -> bool:
        return self.draining and self.idle

    def cancel_all(self) -> None:
        for handle in list(self.active):
            handle.cancel()

    def close(self) -> None:
        self.cancel_all()
        self.loaded.wait(timeout=60)
        if self.model is not None and self.close_model:
            self.model.close()
        if self.kv_events is not None:
            self.kv_events.close()


def _kv_publisher(config: ServerConfig):
    if config.kv_events_endpoint is None:
        return None
    from .kv_events import KVEventPublisher

    return KVEventPublisher(config.kv_events_endpoint, config.kv_events_topic)
