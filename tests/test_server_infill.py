"""/infill as llama-server answers it: on tests/encoders.py's FIM model, the prompt laid out as
llama-server lays it out (its detokenized prompt, stored in tests/data/infill.json by
tests/make_infill_data.py), the same greedy tokens, streaming; a clear 400 on SmolLM2, whose
vocabulary has no FIM prefix/suffix/middle tokens, and for malformed bodies."""
from __future__ import annotations

import json

import httpx
import pytest

from conftest import DATA
from encoders import write_fim_model
from test_server_harness import LiveServer, assert_error, server, smollm  # noqa: F401 (fixtures)

from ember.app import ModelConfig, ServerConfig, create_app, load_model
from ember.server.llamacpp.infill import CHUNK_SEPARATOR, extra_ids

PEER = json.loads((DATA / "infill.json").read_text())


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory):
    path = write_fim_model(tmp_path_factory.mktemp("fim") / "fim.gguf")
    model = load_model(ModelConfig(str(path), device="cpu", threads=2, ctx=PEER["n_ctx"], slots=2))
    with LiveServer(create_app(ServerConfig(), lambda: model, close_model=True)) as s:
        s.wait_ready()
        yield s


@pytest.mark.parametrize("i", range(len(PEER["cases"])))
def test_infill_as_llama_server(fim_server, i):
    case = PEER["cases"][i]
    r = httpx.post(fim_server.url + "/infill", json={**case["request"], "n_predict": 16, "temperature": 0,
                                                      "return_tokens": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt"] == case["prompt"]
    assert body["tokens_evaluated"] == case["prompt_tokens"]
    assert body["tokens"] == case["tokens"] and body["content"] == case["content"]


def test_infill_streams(fim_server):
    case = PEER["cases"][0]
    with httpx.stream("POST", fim_server.url + "/infill", json={**case["request"], "n_predict": 16,
                                                                "temperature": 0, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == case["content"] and events[-1]["stop"]


def test_infill_refusals(fim_server, server):
    err = assert_error(httpx.post(server.url + "/infill", json={"input_prefix": "a", "input_suffix": "b"}), 400,
                       "input_prefix", "fim_not_supported")
    assert "prefix, suffix, middle" in err["message"]  # SmolLM2 has <reponame> only
    url = fim_server.url + "/infill"
    assert_error(httpx.post(url, json={"input_suffix": "b"}), 400, "input_prefix", "missing_field")
    assert_error(httpx.post(url, json={"input_prefix": "a"}), 400, "input_suffix", "missing_field")
    assert_error(httpx.post(url, json={"input_prefix": {"a": 1}, "input_suffix": ""}), 400, "input_prefix")
    assert_error(httpx.post(url, json={"input_prefix": "a", "input_suffix": "", "input_extra": {"text": "x"}}), 400,
                 "input_extra")
    assert_error(httpx.post(url, json={"input_prefix": "a", "input_suffix": "", "input_extra": [{"name": "x"}]}),
                 400, "input_extra[0].text", "missing_field")
    assert_error(httpx.post(url, json={"input_prefix": "a", "input_suffix": "", "prompt": 3}), 400, "prompt")


def test_extra_files_without_a_file_separator():
    """Without [FIM_SEP], extra files are joined by llama-server's snippet separator."""
    text = lambda s: [ord(c) for c in s]  # noqa: E731 (characters as ids)
    ids = extra_ids({"fim_pre": 1, "fim_suf": 2, "fim_mid": 3}, text, (("a.py", "A"), ("b.py", "B")))
    assert ids == text(CHUNK_SEPARATOR + "A" + CHUNK_SEPARATOR + "B")
