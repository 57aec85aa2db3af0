"""Running ember's HTTP server in-process for the server tests (no tests here).

The server runs under uvicorn, configured as `ember serve` configures it, in a thread on a free
port and is reached over real HTTP; the model (SmolLM2) is loaded once per session and shared
by the apps the tests build.
"""
from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn

from ember.app import ModelConfig, ServerConfig, create_app, load_model, uvicorn_config

MODEL_CFG = ModelConfig("smollm2", device="cpu", threads=2, ctx=1024, slots=4)


class LiveServer:
    """uvicorn serving `app` (an ember app, or a wrapper of one with its `state`) in a thread
    on a free port."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn_config(app, app.state.ember.config, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def state(self):
        return self.app.state.ember

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def wait_ready(self, timeout: float = 30) -> None:
        if not self.state.loaded.wait(timeout) or self.state.model is None:
            raise RuntimeError("the model did not load")


def assert_error(r: httpx.Response, status: int, param=..., code=..., extra: set[str] = frozenset()) -> dict:
    """`r` is an OpenAI-style error with this status (and param and code, where given); `extra`:
    the fields besides message, type, param and code it carries."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} | set(extra) and err["message"], err
    assert "Traceback" not in r.text
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    return err


def wait_for(condition, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_model(model, **config) -> LiveServer:
    """A LiveServer (not started) for an already loaded model, with ServerConfig fields."""
    return LiveServer(create_app(ServerConfig(**config), lambda: model, close_model=False))


def wait_idle(engine, timeout: float = 30) -> None:
    """Until no sequence runs or waits (cancellations take effect at the next engine step)."""
    deadline = time.monotonic() + timeout
    while engine.scheduler.running or engine.scheduler.waiting or engine._inbox.qsize():
        if time.monotonic() > deadline:
            raise AssertionError("the engine still has sequences")
        time.sleep(0.01)


def pages_leaked(engine, timeout: float = 5) -> int:
    """Once the engine is idle: pages still taken after the prefix cache is emptied."""
    wait_idle(engine)
    engine.clear_cache()  # takes effect at the engine loop's next turn
    deadline = time.monotonic() + timeout
    while engine.pool.n_free < engine.pool.n_pages and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.pool.n_pages - engine.pool.n_free


@pytest.fixture(scope="session")
def smollm():
    model = load_model(MODEL_CFG)
    yield model
    model.close()


@pytest.fixture(scope="session")
def server(smollm):
    with serve_model(smollm) as live:
        live.wait_ready()
        yield live
