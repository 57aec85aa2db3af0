"""A request's trip through the server: which floors and modules of ember/server it enters, in order.

    python bench/trip.py [--model smollm2] [--json FILE]

Sends a few requests (a chat completion; the same with tools, streamed; /v1/completions; a
streamed /completion with return_progress) to the app in process (starlette's TestClient), with
a profile hook on every thread. Each Python function that starts in a module of ember/server
appends that module to the request's path (a coroutine or generator counts when it starts, not
each time it resumes); consecutive calls in one module are one visit. Printed per request:

  floors   the path over the server's floors -- http (middleware, streams, the shared ends of
           every route), api (an API's parsing and formatting) and core (prompts, tools, engine
           requests, reading replies) -- with a run of repeated steps written once with its
           count (a stream's per-token loop), and the visits per floor. The route handlers
           themselves are left out: they only call the floors in turn;
  modules  the visits per module, libraries left out (fields.py's typed JSON reads, the typed
           request's values, the JSON scanner, the token floor, errors): every floor calls them.

Module names of the layout before the API packages are mapped to floors too (openai.py and
llamacpp.py: api; generation, prompts, tools, grammars, replies: core), so that two versions of
the server can be compared: a trip that goes down the floors and back up once reads
http > api > core > api > http. Not a speed benchmark: nothing is compared with a peer.
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import threading
from collections import Counter
from pathlib import Path

from starlette.testclient import TestClient

import ember.server
from ember.app import ModelConfig, ServerConfig, create_app, load_model

SERVER = str(Path(ember.server.__file__).parent) + "/"
HTTP = {"guard", "origins", "connection", "sse", "state", "metrics", "exchange"}
CORE = {"generation", "prompts", "tools", "grammars", "replies"}  # the layout before core/
LIBRARIES = {"fields", "core/request", "core/jsonscan", "jsonscan", "tokenfloor", "errors"}
RESUMABLE = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
REQUESTS = {
    "chat": ("/v1/chat/completions", {"messages": ASK, "max_tokens": 4, "temperature": 0}),
    "chat+tools, streamed": ("/v1/chat/completions", {"messages": ASK, "tools": [TOOL], "tool_choice": "required",
                                                      "max_tokens": 16, "temperature": 0, "stream": True}),
    "completions": ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
    "/completion, streamed": ("/completion", {"prompt": "The capital of France is", "n_predict": 4, "stream": True,
                                              "return_progress": True, "temperature": 0}),
}


class Recorder:
    """The modules of ember/server whose functions start, in order, while `on`."""

    def __init__(self):
        self.on = False
        self.skip: set = set()  # code objects not recorded (the route handlers: they only orchestrate)
        self.modules: list[str] = []
        self._started: dict[int, object] = {}  # id -> frame, for resumable frames seen (kept alive: ids stay unique)

    def hook(self, frame, event, arg):
        if not self.on or event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(SERVER) or frame.f_code in self.skip:
            return
        if frame.f_code.co_flags & RESUMABLE:
            if id(frame) in self._started:
                return
            self._started[id(frame)] = frame
        self.modules.append(path[len(SERVER):].removesuffix(".py"))

    def take(self) -> list[str]:
        out, self.modules = self.modules, []
        self._started.clear()
        return out


def visits(modules: list[str]) -> list[str]:
    """Consecutive calls in one module are one visit."""
    return [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]


def floor(module: str) -> str:
    if module in HTTP:
        return "http"
    return "core" if module.startswith("core/") or module in CORE else "api"


def folded(path: list[str], longest: int = 6) -> list[str]:
    """`path` with each run of a repeated step sequence written once, with its count."""
    out, i = [], 0
    while i < len(path):
        best = (1, 1)  # (length, repeats)
        for k in range(1, longest + 1):
            reps = 1
            while path[i + reps * k:i + (reps + 1) * k] == path[i:i + k]:
                reps += 1
            if reps > 1 and k * reps > best[0] * best[1]:
                best = (k, reps)
        k, reps = best
        out.append(" > ".join(path[i:i + k]) if reps == 1 else f"({' > '.join(path[i:i + k])}) x{reps}")
        i += k * reps
    return out


def trip(recorder: Recorder, client: TestClient, path: str, body: dict) -> dict:
    recorder.on = True
    try:
        r = client.post(path, json=body)
        r.read()
    finally:
        recorder.on = False
    assert r.status_code == 200, r.text
    modules = recorder.take()
    floors = visits([floor(m) for m in modules if m not in LIBRARIES])
    seq = visits([m for m in modules if m not in LIBRARIES])
    return {"floors": floors, "floor_path": folded(floors), "floor_visits": dict(Counter(floors)),
            "path": seq, "visits": dict(Counter(seq)), "total": len(seq)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    recorder = Recorder()
    threading.setprofile(recorder.hook)
    sys.setprofile(recorder.hook)
    model = load_model(ModelConfig(args.model, device="cpu", threads=2, ctx=1024, slots=2))
    results = {}
    app = create_app(ServerConfig(), lambda: model, close_model=False)
    recorder.skip = {route.endpoint.__code__ for route in app.routes}
    with TestClient(app, base_url="http://localhost") as client:
        client.app.state.ember.loaded.wait(60)
        for name, (path, body) in REQUESTS.items():
            trip(recorder, client, path, body)  # warm: grammars compiled, caches filled
            results[name] = trip(recorder, client, path, body)
    sys.setprofile(None)
    threading.setprofile(None)
    model.close()
    for name, r in results.items():
        print(f"== {name} ({REQUESTS[name][0]})")
        print(f"   floors: {' > '.join(r['floor_path'])}")
        print("     visits " + ", ".join(f"{m} {n}" for m, n in r["floor_visits"].items()))
        order = sorted(r["visits"].items(), key=lambda kv: r["path"].index(kv[0]))
        print(f"   modules: {r['total']} visits: " + ", ".join(f"{m} {n}" for m, n in order))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
