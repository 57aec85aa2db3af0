"""ember serve against hostile and careless clients, over real HTTP and raw sockets on SmolLM2:
big bodies do not stall other requests, one request cannot fill the queue, text that is not
Unicode is a 400 everywhere, random bodies never give a 500, web pages cannot drive a local
server (Host and Origin checks), and connections that stall or vanish are cut off quietly."""
from __future__ import annotations

import copy
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import replace

import httpx
import pytest

from test_server_harness import (LiveServer, assert_error, free_port, serve_model, server, smollm,  # noqa: F401
                                 wait_for, wait_idle)
from conftest import golden
from ember.app import ServerConfig, create_app, for_address
from ember.gguf_loader import GGUFFile
from ember.server.tokenfloor import TokenFloor
from ember.tokenizer import Tokenizer
from ember.cli import build_parser, server_config
from ember.server.origins import is_loopback

ASK = [{"role": "user", "content": "Say hi."}]
BIG = 10_000_000  # characters: a 10 MB body


class Probe:
    """ASGI wrapper around the real app recording, per path, when a request's body has been
    received in full and when its response started (what the server did, in order)."""

    def __init__(self, app):
        self.app, self.events = app, {}
        self.state = app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]

        async def probed_receive():
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body"):
                self.events.setdefault(path, []).append("body")
            return message

        async def probed_send(message):
            if message["type"] == "http.response.start":
                self.events.setdefault(path, []).append("response")
            await send(message)

        await self.app(scope, probed_receive, probed_send)


class Spy:
    """Wraps a real object and records when it starts and ends work on a long input."""

    LONG = 100_000

    def __init__(self, real, events: list, methods: tuple[str, ...]):
        self.real, self.events, self.methods = real, events, methods

    def __getattr__(self, name):
        method = getattr(self.real, name)
        if name not in self.methods:
            return method

        def recorded(data, *args, **kwargs):
            size = len(data) if isinstance(data, str) else sum(len(p) if isinstance(p, str) else 1 for p in data)
            if size < self.LONG:
                return method(data, *args, **kwargs)
            self.events.append(name)
            try:
                return method(data, *args, **kwargs)
            finally:
                self.events.append(name + " done")

        return recorded


@pytest.fixture(scope="module")
def probed(smollm):
    """A server whose tokenizer records when its text-to-ids engine (where the work is) and its
    decoder start and end on long inputs."""
    events: list = []
    tokenizer = copy.copy(smollm.tokenizer)
    tokenizer._engine = Spy(smollm.tokenizer._engine, events, ("encode_parts",))
    model = replace(smollm, tokenizer=Spy(tokenizer, events, ("decode",)))
    probe = Probe(create_app(ServerConfig(max_body_bytes=32 << 20), lambda: model, close_model=False))
    with LiveServer(probe) as live:
        live.wait_ready()
        yield live, probe, events


def _in_thread(fn):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # reported by the test that joins
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


# ---- big bodies do not block the event loop ----

def test_health_answers_while_a_10mb_tokenize_runs(probed, smollm):
    live, probe, events = probed
    events.clear()
    text = "hello world " * (BIG // 12)
    thread, out = _in_thread(lambda: httpx.post(live.url + "/tokenize", json={"content": text}, timeout=300))
    wait_for(lambda: "encode_parts" in events, timeout=120)
    r = httpx.get(live.url + "/health", timeout=300)
    # /health answered while the tokenizer was still at work on the 10 MB
    assert r.status_code == 200 and events == ["encode_parts"] and probe.events["/tokenize"] == ["body"]
    thread.join(300)
    big = out["value"]
    assert big.status_code == 200
    tokens = big.json()["tokens"]
    assert tokens[:4] == smollm.tokenizer.encode("hello world hello world", add_special=False)
    assert len(tokens) == 2 * (BIG // 12) + 1  # "hello", " world", " hello", ..., " world", " "


def test_10mb_chat_message_is_refused_without_tokenizing(probed):
    live, _, events = probed
    events.clear()
    body = {"messages": [{"role": "user", "content": "x" * BIG}], "max_tokens": 1}
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=300)
    err = assert_error(r, 400, "messages", "context_length_exceeded", extra={"n_prompt_tokens", "n_ctx"})
    assert err["type"] == "exceed_context_size_error" and "at least" in err["message"]
    assert err["n_ctx"] == 1024 and 1024 < err["n_prompt_tokens"] <= BIG
    assert events == []  # refused by the text's length: never tokenized


def test_10mb_completion_prompt_is_refused_without_tokenizing(probed):
    live, _, events = probed
    events.clear()
    r = httpx.post(live.url + "/completion", json={"prompt": "y" * BIG, "n_predict": 1}, timeout=300)
    err = assert_error(r, 400, "prompt", "context_length_exceeded", extra={"n_prompt_tokens", "n_ctx"})
    assert "at least" in err["message"] and events == []


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_token_floor_is_a_lower_bound(model_path, name):
    """The bound that refuses prompts untokenized never exceeds the true count: llama.cpp's test
    strings, special-token text, runs, bytes the vocabulary lacks, random text."""
    with GGUFFile(model_path(name)) as f:
        tok = Tokenizer.from_metadata(f.metadata)
    floor = TokenFloor.of(tok)
    assert floor is not None and floor.longest >= 16
    rng = random.Random(5)
    alphabet = "ab \n\t\x04\x06\x13é中😀<|im_start|><start_of_turn>#-" + "".join(map(chr, range(32)))
    texts = [c["text"] for c in golden(name, "tokenize")["cases"]]
    texts += ["\x04" * 500, "#" * 5000, "\n" * 999, " " * 777, "<|im_start|>" * 50, "<start_of_turn>" * 50,
              tok.token_bytes[max(range(tok.n_vocab), key=lambda t: len(tok.token_bytes[t]))].decode("utf-8", "replace")]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400))) for _ in range(300)]
    for text in texts:
        for parse_special in (False, True):
            assert floor.tokens(text) <= len(tok.encode(text, add_special=False, parse_special=parse_special)), text


def test_health_answers_while_a_10mb_detokenize_runs(probed, smollm):
    live, _, events = probed
    events.clear()
    ids = smollm.tokenizer.encode(" hello", add_special=False) * 1_500_000
    thread, out = _in_thread(lambda: httpx.post(live.url + "/detokenize", json={"tokens": ids}, timeout=300))
    wait_for(lambda: "decode" in events, timeout=120)
    assert httpx.get(live.url + "/health", timeout=300).status_code == 200
    assert events == ["decode"]
    thread.join(300)
    assert out["value"].json()["content"] == " hello" * 1_500_000


# ---- one request cannot fill the queue ----

def test_258_prompts_are_refused_naming_the_limit(server):
    r = httpx.post(server.url + "/completion", json={"prompt": ["Hi"] * 258, "n_predict": 1})
    err = assert_error(r, 400, "prompt", "too_many_sequences")
    assert "258" in err["message"] and "16" in err["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ["Hi"] * 4, "n": 5, "max_tokens": 1})
    err = assert_error(r, 400, "prompt", "too_many_sequences")
    assert "20" in err["message"] and "16" in err["message"]
    assert_error(httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "n": 17}), 400, "n")


def test_the_sequence_limit_is_configurable(smollm):
    with serve_model(smollm, max_sequences=2) as live:
        live.wait_ready()
        ok = httpx.post(live.url + "/completion", json={"prompt": ["Hi", "Yo"], "n_predict": 1})
        assert ok.status_code == 200 and len(ok.json()) == 2
        assert_error(httpx.post(live.url + "/completion", json={"prompt": ["a", "b", "c"], "n_predict": 1}), 400,
                     "prompt", "too_many_sequences")


# ---- text that is not Unicode ----

LONE = "\ud800"
SURROGATE_CASES = [
    ("/apply-template", {"messages": [{"role": "user", "content": "a" + LONE}]}, "messages[0].content"),
    ("/apply-template", {"messages": ASK, "tools": [{"type": "function", "function": {
        "name": "f", "description": LONE}}]}, "tools[0].function.description"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": LONE}, *ASK]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": ASK, "stop": ["x", LONE]}, "stop[1]"),
    ("/v1/chat/completions", {"messages": ASK, "grammar": 'root ::= "' + LONE + '"'}, "grammar"),
    ("/v1/completions", {"prompt": LONE}, "prompt"),
    ("/completion", {"prompt": ["a", [1, LONE]]}, "prompt[1][1]"),
    ("/completion", {"prompt": "a", "json_schema": {"const": LONE}}, "json_schema.const"),
    ("/tokenize", {"content": "ok " + LONE}, "content"),
    ("/completion", {"prompt": "a", LONE: 1}, None),
]


@pytest.mark.parametrize("path,body,param", SURROGATE_CASES, ids=[f"{p}:{q}" for p, _, q in SURROGATE_CASES])
def test_lone_surrogates_are_400(server, path, body, param):
    raw = json.dumps(body).encode()  # ASCII JSON: the surrogate travels as the escape \ud800
    assert b"\\ud800" in raw
    err = assert_error(httpx.post(server.url + path, content=raw), 400, param, "invalid_unicode")
    assert "\\ud800" in err["message"] and "surrogate" in err["message"]


def test_surrogate_pairs_are_text(server):
    r = httpx.post(server.url + "/tokenize", content=b'{"content": "a\\ud83d\\ude00"}')
    assert r.status_code == 200
    back = httpx.post(server.url + "/detokenize", json={"tokens": r.json()["tokens"]})
    assert back.json()["content"] == "a\U0001F600"


# ---- random bodies never give a 500 ----

ROUTES = {
    "/v1/chat/completions": {"messages": ASK, "max_tokens": 2},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/completion": {"prompt": "Hi", "n_predict": 2},
    "/completions": {"prompt": "Hi", "n_predict": 2},
    "/tokenize": {"content": "Hi", "with_pieces": True},
    "/detokenize": {"tokens": [12, 13]},
    "/apply-template": {"messages": ASK},
}
FIELDS = ["messages", "prompt", "content", "tokens", "n", "max_tokens", "n_predict", "stream", "stop", "temperature",
          "top_k", "top_p", "min_p", "seed", "logit_bias", "logprobs", "top_logprobs", "n_probs", "response_format",
          "tools", "tool_choice", "grammar", "json_schema", "samplers", "dry_sequence_breakers", "stream_options",
          "chat_template_kwargs", "continue_final_message", "add_generation_prompt", "response_fields",
          "return_progress", "timings_per_token", "return_tokens", "with_pieces", "add_special", "parse_special",
          "model", "mirostat", "repeat_last_n", "ignore_eos", "post_sampling_probs", "id_slot", "cache_prompt"]


STRINGS = ["", "x", "text", "\u00e9\u4e2d", "<|im_start|>", "root ::= [a]", "auto", "0", "\n", "\ud800", "a\udfffb"]


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "null", "list", "dict", "big", "neg", "special"]
    kind = rng.choice(kinds if depth < 3 else kinds[:5])
    if kind == "int":
        return rng.randint(-3, 40)
    if kind == "float":
        return rng.choice([0.5, -1.5, 1e308, -0.0, 3.0])
    if kind == "str":
        return rng.choice(STRINGS)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "big":
        return rng.choice([2 ** 63, 10 ** 30, 2 ** 31])
    if kind == "neg":
        return rng.choice([-1, -2 ** 40])
    if kind == "special":
        return rng.choice([{"type": "json_object"}, {"type": "function", "function": {"name": "f"}},
                           [{"role": "user", "content": "x"}], [1, "a"], {"1": -100}, ["min_p"], [[1, 2]],
                           {"prompt_string": "x"}, [{"role": "assistant", "content": "x"}]])
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(FIELDS + ["role", "content", "type", "function"]): random_value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def mutated(rng: random.Random, base: dict) -> bytes:
    """`base` with one to three fields (or a message's fields) replaced or removed, or not JSON."""
    body = json.loads(json.dumps(base))
    for _ in range(rng.randint(1, 3)):
        target = body
        if "messages" in body and isinstance(body["messages"], list) and body["messages"] and rng.random() < 0.3:
            target = body["messages"][0] if isinstance(body["messages"][0], dict) else body
        action = rng.random()
        if action < 0.6:
            target[rng.choice(FIELDS + ["role", "content"])] = random_value(rng)
        elif action < 0.8 and target:
            target.pop(rng.choice(sorted(target)))
        else:
            return rng.choice([b"{", b"[]", b"null", b'{"a":1}{', b"\x80\x81", b'"str"', b"{\"prompt\": 1e999}"])
    for key in ("max_tokens", "n_predict"):  # keeps the work of one body small (absent: until the context is full)
        if key in base and not (isinstance(body.get(key), int) and not isinstance(body[key], bool)
                                and 0 <= body[key] <= 4):
            body[key] = 3
    body.pop("max_completion_tokens", None)
    return json.dumps(body).encode()


def test_random_bodies_never_give_a_500(server, smollm):
    rng = random.Random(1234)
    seen = set()
    for _ in range(300):
        path = rng.choice(sorted(ROUTES))
        raw = mutated(rng, ROUTES[path])
        r = httpx.post(server.url + path, content=raw, timeout=120)
        seen.add(r.status_code)
        assert r.status_code < 500, (path, raw[:300], r.text[:500])
        if r.status_code >= 400:
            assert_error(r, r.status_code)
    assert 200 in seen and 400 in seen
    wait_idle(smollm.engine)


def test_random_requests_to_the_other_routes_never_give_a_500(server):
    rng = random.Random(99)
    paths = ["/health", "/v1/health", "/props", "/slots", "/metrics", "/v1/models", "/models", "/nowhere"]
    for _ in range(60):
        method = rng.choice(["GET", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"])
        path = rng.choice(paths + [f"/slots/{rng.choice([0, 3, 9, -1, 'x'])}?action="
                                   f"{rng.choice(['erase', 'save', 'restore', '', '%ff'])}"])
        r = httpx.request(method, server.url + path, content=mutated(rng, {"x": 1}))
        assert r.status_code < 500, (method, path, r.text[:300])


# ---- web pages cannot drive a local server ----

def test_dns_rebinding_host_is_refused(server):
    # a page on evil.example whose name was rebound to 127.0.0.1 sends Host: evil.example
    for path in ("/health", "/v1/models"):
        err = assert_error(httpx.get(server.url + path, headers={"Host": "evil.example"}), 403, None,
                           "host_not_allowed")
        assert "--allowed-hosts" in err["message"]
    r = httpx.post(server.url + "/completion", json={"prompt": "Hi", "n_predict": 1},
                   headers={"Host": "evil.example:8080"})
    assert_error(r, 403, None, "host_not_allowed")
    for host in ("localhost", "localhost:8080", "127.0.0.1", "127.0.0.5:80", "[::1]:8080", "app.localhost"):
        assert httpx.get(server.url + "/health", headers={"Host": host}).status_code == 200, host


def test_allowed_hosts_are_configurable(smollm):
    with serve_model(smollm, allowed_hosts=("models.lan",)) as live:
        live.wait_ready()
        assert httpx.get(live.url + "/health", headers={"Host": "models.lan:8080"}).status_code == 200
        assert_error(httpx.get(live.url + "/health", headers={"Host": "evil.example"}), 403)
    with serve_model(smollm, allowed_hosts=("*",)) as live:
        live.wait_ready()
        assert httpx.get(live.url + "/health", headers={"Host": "evil.example"}).status_code == 200


def test_hosts_follow_the_listening_address():
    args = build_parser().parse_args(["serve"])
    assert for_address(server_config(args), "127.0.0.1").allowed_hosts == ("localhost",)
    assert for_address(server_config(args), "0.0.0.0").allowed_hosts == ("*",)
    given = build_parser().parse_args(["serve", "--allowed-hosts", "a.lan,b.lan", "--host", "0.0.0.0"])
    assert for_address(server_config(given), "0.0.0.0").allowed_hosts == ("a.lan", "b.lan")


@pytest.mark.parametrize("name,loopback", [
    ("localhost", True), ("LOCALHOST.", True), ("api.localhost", True), ("127.0.0.1", True), ("127.9.8.7", True),
    ("::1", True), ("::ffff:127.0.0.1", True), ("0.0.0.0", False), ("10.0.0.1", False),
    ("localhost.evil.example", False), ("evil.example", False), ("", False)])
def test_loopback_names(name, loopback):
    assert is_loopback(name) is loopback


def test_cross_site_requests_are_refused(server):
    # a form post or fetch from any web page: no preflight needed for text/plain
    for origin in ("http://evil.example", "https://localhost.evil.example", "null"):
        r = httpx.post(server.url + "/completion", content=b'{"prompt": "Hi", "n_predict": 1}',
                       headers={"Origin": origin, "Content-Type": "text/plain"})
        assert_error(r, 403, None, "origin_not_allowed")
        assert "access-control-allow-origin" not in r.headers
        r = httpx.post(server.url + "/slots/0?action=erase", headers={"Origin": origin})
        assert_error(r, 403, None, "origin_not_allowed")


def test_loopback_origins_are_allowed_on_any_port(server):
    for origin in ("http://localhost:3000", "http://127.0.0.1:5173", "http://[::1]:8000", "https://localhost"):
        r = httpx.post(server.url + "/tokenize", json={"content": "Hi"}, headers={"Origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert "origin" in r.headers["vary"].lower()


def test_cors_star_allows_every_origin(smollm):
    with serve_model(smollm, cors_origins=("*",)) as live:
        live.wait_ready()
        r = httpx.post(live.url + "/tokenize", json={"content": "Hi"}, headers={"Origin": "http://evil.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://evil.example"


# ---- connections that stall or vanish ----

def test_disconnect_mid_body_logs_no_traceback(server, caplog):
    caplog.set_level(logging.INFO)
    host, port = server.url.removeprefix("http://").split(":")
    for _ in range(5):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100000\r\n\r\n" + b'{"messages": [')
    assert httpx.get(server.url + "/health").status_code == 200
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not noisy, [r.getMessage() for r in noisy]


def _raw(url: str, timeout: float = 60) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.settimeout(timeout)
    return s


def _read_all(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def test_slow_headers_are_cut_off(smollm):
    with serve_model(smollm, header_timeout_s=0.5) as live:
        live.wait_ready()
        with _raw(live.url) as idle, _raw(live.url) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-A: ")
            assert _read_all(idle) == b""  # closed by the server: no request line ever came
            assert _read_all(slow) == b""  # headers never finished
        # a prompt client is unaffected
        assert httpx.get(live.url + "/health").status_code == 200


def test_slow_bodies_are_cut_off_with_408(smollm):
    with serve_model(smollm, body_timeout_s=0.5) as live:
        live.wait_ready()
        with _raw(live.url) as s:
            s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000\r\n\r\n{\"content\": ")
            reply = _read_all(s)
        assert reply.startswith(b"HTTP/1.1 408 ")
        assert httpx.post(live.url + "/tokenize", json={"content": "Hi"}).status_code == 200


def test_sigterm_keeps_answering_503_during_the_grace_period():
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # a context long enough that the stream outlasts the grace period also where drafts speed a
    # repetitive story up (512 tokens could finish within it, ending the stream without the cancel)
    proc = subprocess.Popen([sys.executable, "-m", "ember", "serve", "smollm2", "--port", str(port), "--threads", "1",
                             "--ctx", "8192", "--slots", "2", "--shutdown-grace", "4", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _status(url + "/health") == 200, timeout=60)
        body = {"prompt": "Once upon a time", "max_tokens": 5000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            # while the stream runs on, the server still listens and refuses new work with 503
            wait_for(lambda: _status(url + "/health") == 503)
            refused = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            assert_error(refused, 503)
            assert int(refused.headers["retry-after"]) >= 1
            rest = list(lines)  # ends: the stream is cancelled after the grace period
        events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "cancelled"
        assert proc.wait(timeout=30) == 0
        assert _status(url + "/health") == 0  # closed once drained
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.stdout.read().decode()
    assert "Traceback" not in output and "ERROR" not in output, output


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.TransportError:
        return 0
