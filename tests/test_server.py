"""ember serve over real HTTP on SmolLM2: the official openai client for the OpenAI routes
(chat, completions, streaming, tools, json_schema, logprobs) and httpx for llama-server's.
Greedy replies, log-probabilities and tokenizations are compared with llama.cpp's (the golden
data in tests/data, with the bounds test_golden.py uses)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from conftest import golden
from test_golden import CLEAR_MARGIN, MAX_STEP_ERR, case_prompt, margin
from test_server_harness import pages_leaked, serve_model, server, smollm, wait_idle  # noqa: F401 (fixtures)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 60},
                                                    "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
                   "required": ["query", "limit"]}}}
TOOLS = [WEATHER, SEARCH]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def case(name: str) -> dict:
    """A golden case of llama.cpp's on SmolLM2, with `clear`: its steps before the first near-tie
    (where greedy generation must agree)."""
    c = next(c for c in golden("smollm2", "greedy")["cases"] if c["name"] == name)
    clear = next((i for i, s in enumerate(c["steps"]) if margin(s) < CLEAR_MARGIN), len(c["completion_ids"]))
    return {**c, "clear": clear}


def golden_text(smollm, ids: list[int]) -> str:
    return smollm.tokenizer.decode(ids)


def check_call(call, names=("get_weather", "search")) -> dict:
    """A tool call is a known function with arguments valid against its schema."""
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema_of(call.function.name))
    return args


# ---- OpenAI routes ----

def test_models_lists_the_loaded_model(client, smollm):
    models = client.models.list().data
    assert [m.id for m in models] == [smollm.id] == ["SmolLM2-135M-Instruct.Q4_1"]


def test_chat_completion(client, smollm):
    ref = case("chat_json")  # 21 clear greedy steps
    messages = [{"role": "user", "content": case_prompt("chat_json")}]
    r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=ref["clear"], temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == smollm.id
    assert choice.message.role == "assistant"
    assert choice.message.content == golden_text(smollm, ref["completion_ids"][:ref["clear"]])
    assert choice.finish_reason == "length" and r.usage.completion_tokens == ref["clear"]
    assert r.usage.prompt_tokens == len(ref["prompt_ids"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # the same conversation again: its prompt comes from the prefix cache
    again = client.chat.completions.create(model=smollm.id, messages=messages, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1


def test_chat_stream_with_usage(client, smollm):
    ref = case("chat_json")
    stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": case_prompt(
        "chat_json")}], max_tokens=6, stream=True, temperature=0, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"] and text == golden_text(smollm, ref["completion_ids"][:6])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 6 and usage.prompt_tokens == len(ref["prompt_ids"])
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_n_samples_and_stop(client):
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Count: 1, 2, 3"}],
                                       n=3, max_tokens=10, temperature=1.0, seed=7, stop=["\n"], logprobs=True)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    counts = []
    for c in r.choices:
        counts.append(len(c.logprobs.content))
        assert "\n" not in c.message.content
        assert counts[-1] == 10 if c.finish_reason == "length" else c.finish_reason == "stop" and counts[-1] <= 10
    assert r.usage.completion_tokens == sum(counts)  # counted over all three samples
    assert len({c.message.content for c in r.choices}) > 1  # distinct seeds per sample


def test_chat_logprobs_match_llama_cpp(client, smollm):
    ref = case("chat_json")
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": case_prompt(
        "chat_json")}], max_tokens=ref["clear"], logprobs=True, top_logprobs=3, temperature=0)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == ref["clear"]
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    for e, step in zip(entries, ref["steps"]):
        assert bytes(e.bytes) == smollm.tokenizer.token_to_piece(step["id"], special=True)  # llama.cpp's token
        assert abs(e.logprob - step["logprob"]) <= MAX_STEP_ERR, (e.token, e.logprob, step["logprob"])
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        theirs = {smollm.tokenizer.token_to_piece(t, special=True) for t, _ in step["top"]}
        assert {bytes(alt.bytes) for alt in e.top_logprobs} <= theirs  # among llama.cpp's 10 most likely


def test_logit_bias_forces_a_token(client, smollm):
    token = smollm.tokenizer.encode(" banana", add_special=False)[0]
    r = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=3, logit_bias={str(token): 100})
    assert r.choices[0].message.content == " banana" * 3


def test_completions_text_ids_and_several_prompts(client, smollm):
    count, capital = case("count"), case("capital")
    r = client.completions.create(model="smollm2", prompt=[case_prompt("count"), capital["prompt_ids"]], n=2,
                                  max_tokens=capital["clear"], temperature=0, stop=[" 7"], logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices[:2]:  # " 6, 7" as llama.cpp goes on, cut at the stop string
        assert c.text == " 6," and c.finish_reason == "stop"
    for c in r.choices[2:]:
        assert c.text == golden_text(smollm, capital["completion_ids"][:capital["clear"]])
        assert c.finish_reason == "length"
    lp = r.choices[2].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == capital["clear"]
    assert "".join(lp.tokens) == r.choices[2].text and all(len(t) == 2 for t in lp.top_logprobs)
    for ours, step in zip(lp.token_logprobs, capital["steps"]):
        assert abs(ours - step["logprob"]) <= MAX_STEP_ERR
    assert r.usage.prompt_tokens == len(count["prompt_ids"]) + len(capital["prompt_ids"])


def test_completions_stream(client, smollm):
    ref = case("capital")
    chunks = list(client.completions.create(model="smollm2", prompt=case_prompt("capital"), max_tokens=ref["clear"],
                                            stream=True, temperature=0))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks) == golden_text(smollm, ref["completion_ids"][:ref["clear"]])


def test_json_schema_response(client):
    schema = {"type": "object", "properties": {"population": {"type": "integer", "minimum": 0},
                                               "city": {"type": "string", "maxLength": 20}},
              "required": ["population", "city"]}
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Give the largest city of France as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
        max_tokens=60, temperature=0)  # greedy: a sampled integer may run past max_tokens
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content)
    jsonschema.validate(value, schema)
    assert list(value) == ["population", "city"]  # the schema's order


def test_json_object_response(client):
    r = client.chat.completions.create(model="smollm2", messages=ASK, response_format={"type": "json_object"},
                                       max_tokens=40, temperature=0)
    content = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert content.lstrip().startswith("{")


# ---- tools ----

def test_tool_choice_required(client):
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=80, temperature=0.8, seed=3)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])


def test_tool_choice_named_function(client):
    for temperature in (0.0, 1.0):
        # room for the rare long sampled query string (at 80 tokens about 1 draw in 150 ran out)
        r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=200,
                                           tool_choice={"type": "function", "function": {"name": "search"}},
                                           temperature=temperature, seed=5)
        (call,) = r.choices[0].message.tool_calls
        args = check_call(call, names=("search",))
        assert 1 <= args["limit"] <= 10


def test_tool_choice_auto_gives_a_call_or_text(client):
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=80, n=2, seed=11)
    for choice in r.choices:
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                check_call(call)
        else:
            assert isinstance(choice.message.content, str)


def test_parallel_tool_calls(client):
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=True, max_tokens=150, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert calls and len({c.id for c in calls}) == len(calls)
    for call in calls:
        check_call(call)


def test_streamed_tool_call_deltas(client):
    stream = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=80, stream=True, temperature=0)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or ():
            entry = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and list(calls) == [0]
    call = calls[0]
    assert call["id"].startswith("call_") and call["name"] in ("get_weather", "search")
    jsonschema.validate(json.loads(call["arguments"]), schema_of(call["name"]))


def test_tool_results_in_the_conversation(client, server):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    prompt = httpx.post(server.url + "/apply-template", json={"messages": history, "tools": TOOLS}).json()["prompt"]
    assert '{"tool_result": {"name": "get_weather", "content": "18 degrees, sunny"}}' in prompt
    assert '"name": "search"' in prompt and "You can use these tools" in prompt
    r = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, max_tokens=30)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


# ---- llama-server routes ----

def test_completion_native_fields(server, smollm):
    ref = case("count")  # 32 clear steps
    r = httpx.post(server.url + "/completion", json={
        "prompt": ref["prompt_ids"], "n_predict": 8, "return_tokens": True, "n_probs": 2, "temperature": 0,
        "cache_prompt": True, "id_slot": -1, "samplers": ["top_k", "temperature"]})
    body = r.json()
    assert r.status_code == 200 and body["stop"] is True and body["stop_type"] == "limit"
    assert body["tokens"] == ref["completion_ids"][:8] and body["tokens_predicted"] == 8
    assert smollm.tokenizer.decode(body["tokens"]) == body["content"]
    probs = body["completion_probabilities"]
    assert [p["id"] for p in probs] == body["tokens"] and all(len(p["top_logprobs"]) == 2 for p in probs)
    for p, step in zip(probs, ref["steps"]):
        assert abs(p["logprob"] - step["logprob"]) <= MAX_STEP_ERR
        assert [t["id"] for t in p["top_logprobs"]][:1] == [step["top"][0][0]]
    assert body["timings"]["predicted_n"] == 8


def test_completion_mixed_prompt(server, smollm):
    hello = smollm.tokenizer.encode("Hello", add_special=False)
    r = httpx.post(server.url + "/completion", json={
        "prompt": [smollm.tokenizer.bos_id or 1, "The sky is", *hello], "n_predict": 2, "return_tokens": True})
    assert r.status_code == 200 and r.json()["tokens_evaluated"] == 1 + len(smollm.tokenizer.encode(
        "The sky is", add_special=False)) + len(hello)


def test_completion_grammar_and_json_schema(server):
    r = httpx.post(server.url + "/completion", json={"prompt": "Is the sky blue? Answer:", "n_predict": 8,
                                                     "grammar": 'root ::= " yes" | " no"'})
    assert r.json()["content"] in (" yes", " no") and r.json()["stop_type"] == "eos"
    schema = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}
    r = httpx.post(server.url + "/completion", json={"prompt": "Is the sky blue? JSON:", "n_predict": 30,
                                                     "json_schema": schema})
    jsonschema.validate(json.loads(r.json()["content"]), schema)


def test_completion_stop_word_and_stream(server):
    r = httpx.post(server.url + "/completion", json={"prompt": "1, 2, 3, 4,", "n_predict": 20, "temperature": 0,
                                                     "stop": [" 6"]})
    assert r.json()["stop_type"] == "word" and r.json()["stopping_word"] == " 6"
    with httpx.stream("POST", server.url + "/completion",
                      json={"prompt": "1, 2, 3,", "n_predict": 3, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert [e["stop"] for e in events] == [False, False, False, True]
    assert events[-1]["tokens_predicted"] == 3


def test_tokenize_matches_llama_cpp(server):
    """/tokenize against llama-server's own /tokenize output, in its three modes."""
    modes = {"ids": (False, False), "ids_add_special": (True, False), "ids_parse_special": (False, True)}
    for ref in golden("smollm2", "tokenize")["cases"]:
        for key, (add_special, parse_special) in modes.items():
            r = httpx.post(server.url + "/tokenize", json={"content": ref["text"], "add_special": add_special,
                                                           "parse_special": parse_special})
            assert r.json()["tokens"] == ref[key], (ref["text"], key)


def test_tokenize_pieces_and_detokenize(server, smollm):
    text = "Hello world, ümlaut"
    r = httpx.post(server.url + "/tokenize", json={"content": text}).json()
    pieces = httpx.post(server.url + "/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == r["tokens"]
    # a piece that is not UTF-8 on its own ("ü" split in two tokens) comes as its bytes
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert joined.decode() == text and any(isinstance(p["piece"], list) for p in pieces)
    special = httpx.post(server.url + "/tokenize", json={"content": "<|im_start|>hi", "add_special": True}).json()
    assert special["tokens"][0] == 1  # <|im_start|>, as llama.cpp parses it
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["content"] == text


def test_apply_template(server):
    r = httpx.post(server.url + "/apply-template", json={"messages": ASK}).json()
    assert r["prompt"].endswith("<|im_start|>assistant\n") and "What is the weather in Paris?" in r["prompt"]


def test_health_props_slots(server, smollm):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    props = httpx.get(server.url + "/props").json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 1024
    assert props["chat_template_tools"] == "generic" and "im_start" in props["chat_template"]
    slots = httpx.get(server.url + "/slots").json()
    assert len(slots) == 4 and {s["id"] for s in slots} == {0, 1, 2, 3}


def test_metrics(server, smollm):
    httpx.post(server.url + "/completion", json={"prompt": "Hi", "n_predict": 2})
    text = httpx.get(server.url + "/metrics").text
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total", "llamacpp:n_decode_total",
                 "llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:kv_cache_usage_ratio",
                 "ember:prefix_cache_hit_ratio", "ember:prompt_tokens_cached_total", "ember:requests_waiting",
                 'ember:time_to_first_token_seconds_bucket{cache="hit",le="+Inf"}',
                 'ember:time_to_first_token_seconds_count{cache="miss"}', 'ember:kv_pages{state="free"}'):
        assert name in text, name
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line[0] != "#"}
    m = smollm.engine.metrics
    assert values["llamacpp:tokens_predicted_total"] >= 2
    assert values["ember:prompt_tokens_cached_total"] <= values["ember:prompt_tokens_total"]
    assert values["ember:prefix_cache_hit_ratio"] == pytest.approx(m.cache_hit_rate, abs=0.05)


def test_slot_erase_empties_the_prefix_cache(server, smollm):
    httpx.post(server.url + "/completion", json={"prompt": "Remember this sentence.", "n_predict": 1})
    wait_idle(smollm.engine)
    assert smollm.engine.kv_usage().cached_tokens > 0
    r = httpx.post(server.url + "/slots/0?action=erase")
    assert r.status_code == 200 and r.json()["n_erased"] > 0
    assert httpx.post(server.url + "/slots/0?action=save").status_code == 400
    assert httpx.post(server.url + "/slots/9?action=erase").status_code == 400


def test_no_pages_leak_after_the_tests(server, smollm):
    assert pages_leaked(smollm.engine) == 0 and not server.state.active


# ---- a template that renders tools itself (the tagged protocol) ----

TAGGED_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions: {{ tools | tojson }}
To call one, write <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", \
"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}\
<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def tagged(tmp_path_factory):
    from dataclasses import replace

    from ember.app import load_model
    from test_server_harness import MODEL_CFG

    path = tmp_path_factory.mktemp("tmpl") / "tools.jinja"
    path.write_text(TAGGED_TEMPLATE)
    model = load_model(replace(MODEL_CFG, chat_template_file=str(path), slots=2))
    with serve_model(model) as live:
        live.wait_ready()
        yield live
    model.close()


def test_tagged_template_renders_tools_natively(tagged):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "x", "limit": 1}'}}]}]
    prompt = httpx.post(tagged.url + "/apply-template", json={"messages": history, "tools": TOOLS}).json()["prompt"]
    assert prompt.startswith("<|im_start|>system\nYou may call these functions: [{")
    assert '<tool_call>{"name": "search", "arguments": {"query": "x", "limit": 1}}</tool_call>' in prompt
    assert httpx.get(tagged.url + "/props").json()["chat_template_tools"] == "tagged"


def test_tagged_template_required_and_named(tagged):
    client = OpenAI(base_url=tagged.url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=80, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    check_call(call)
    stream = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=80, stream=True,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    args, names = "", []
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or ():
            names += [d.function.name] if d.function.name else []
            args += d.function.arguments or ""
    assert names == ["get_weather"]
    jsonschema.validate(json.loads(args), schema_of("get_weather"))
