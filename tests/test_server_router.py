"""Several models in one server (--models-dir): two synthetic decoder files served by one router,
over real HTTP: /v1/models with each model's status, a request's `model` picking the model (loaded
on first use), concurrent requests to both, least-recently-used unloading with models_max=1 (the
unloaded model's file closed) or beyond a memory budget, /models/load and /models/unload, one model taking any name, and
the router's own key check."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from families import write_family
from test_server_harness import assert_error

from ember.app import ModelConfig, ServerConfig, uvicorn_config
from ember.server.router import Router, create_router_app, models_in

MODEL_CFG = ModelConfig("unused", device="cpu", threads=2, ctx=256, slots=2)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("models")
    write_family(out / "qwen2.gguf", "qwen2")
    write_family(out / "smollm3.gguf", "smollm3")
    return out


class RouterServer:
    def __init__(self, models: dict, models_max: int, memory: int | None = None, **config):
        self.config = ServerConfig(**config)
        self.app = create_router_app(Router(models, MODEL_CFG, self.config, models_max, memory))
        self.router = self.app.state.router
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn_config(self.app, self.config, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def statuses(self) -> dict:
        return {m["id"]: m["status"]["value"] for m in httpx.get(self.url + "/v1/models").json()["data"]}


def complete(url: str, model: str | None, **extra) -> httpx.Response:
    body = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0, **extra}
    if model is not None:
        body["model"] = model
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def test_models_are_picked_loaded_and_unloaded(models_dir):
    with RouterServer(models_in(models_dir), models_max=1) as s:
        assert s.statuses() == {"qwen2": "unloaded", "smollm3": "unloaded"}
        r = complete(s.url, "qwen2")
        assert r.status_code == 200 and r.json()["model"] == "qwen2"
        first = s.router.entries["qwen2"].app.state.ember.model
        assert s.statuses() == {"qwen2": "loaded", "smollm3": "unloaded"}
        assert complete(s.url, "smollm3").json()["model"] == "smollm3"
        assert s.statuses() == {"qwen2": "unloaded", "smollm3": "loaded"}  # least recently used went
        assert first.gguf.closed  # its memory is given back
        again = complete(s.url, "qwen2")
        assert again.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]  # the same model, reloaded
        assert httpx.post(s.url + "/models/unload", json={"model": "qwen2"}).json()["success"]
        assert s.statuses()["qwen2"] == "unloaded"
        assert httpx.post(s.url + "/models/load", json={"model": "smollm3"}).json()["model"]["status"]["value"] == \
            "loaded"
        assert httpx.get(s.url + "/props", params={"model": "smollm3"}).json()["model_alias"] == "smollm3"


def test_concurrent_requests_to_both(models_dir):
    with RouterServer(models_in(models_dir), models_max=2) as s:
        async def both():
            async with httpx.AsyncClient(timeout=120) as http:
                asks = [http.post(s.url + "/v1/completions", json={"model": m, "prompt": "Hi", "max_tokens": 8})
                        for m in ("qwen2", "smollm3") * 3]
                return await asyncio.gather(*asks)
        replies = asyncio.run(both())
        assert [r.status_code for r in replies] == [200] * 6
        assert [r.json()["model"] for r in replies] == ["qwen2", "smollm3"] * 3
        assert s.statuses() == {"qwen2": "loaded", "smollm3": "loaded"}


def test_memory_budget(models_dir):
    """Room for one file's bytes: loading the second unloads the first although models_max is 2."""
    size = max(p.stat().st_size for p in models_dir.glob("*.gguf"))
    with RouterServer(models_in(models_dir), models_max=2, memory=size + 1) as s:
        assert complete(s.url, "qwen2").status_code == 200
        assert complete(s.url, "smollm3").status_code == 200
        assert s.statuses() == {"qwen2": "unloaded", "smollm3": "loaded"}


def test_refusals_and_one_model(models_dir):
    with RouterServer(models_in(models_dir), models_max=1, api_keys=("sesame",)) as s:
        key = {"Authorization": "Bearer sesame"}
        assert_error(httpx.get(s.url + "/v1/models"), 401, code="invalid_api_key")
        assert httpx.get(s.url + "/health").status_code == 200
        body = {"prompt": "Hi", "max_tokens": 2}
        assert_error(httpx.post(s.url + "/v1/completions", json={**body, "model": "nope"}, headers=key), 404,
                     "model", "model_not_found")
        assert_error(httpx.post(s.url + "/v1/completions", json=body, headers=key), 400, "model", "missing_field")
        assert_error(httpx.post(s.url + "/models/load", json={}, headers=key), 400, "model")
    with RouterServer({"qwen2": models_dir / "qwen2.gguf"}, models_max=1) as s:
        assert complete(s.url, "gpt-4o").status_code == 200  # one model: any name is it
        assert complete(s.url, None).status_code == 200


def test_draft_model_only_for_models_of_its_vocabulary(models_dir, tmp_path):
    """One --model-draft with several models: the models of its vocabulary get it, another loads
    without it (its own special tokens differ here) instead of failing."""
    from dataclasses import replace

    from ember.engine.speculate import DraftModelConfig, SpecConfig

    other = write_family(tmp_path / "other.gguf", "qwen2", drop="tokenizer.ggml.eos_token_id")
    spec = SpecConfig(("cache", "draft"), model=DraftModelConfig(str(models_dir / "qwen2.gguf")))
    router = Router({**models_in(models_dir), "other": other}, replace(MODEL_CFG, speculative=spec), ServerConfig())
    assert router._speculative_for(router.entries["smollm3"]) == spec
    assert router._speculative_for(router.entries["other"]) == SpecConfig(("cache",))
