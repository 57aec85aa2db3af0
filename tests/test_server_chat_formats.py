"""Each family's chat format through the HTTP API with the `openai` client: SmolLM2 served with a
family's real template (the model writes random text, but the grammar in the family's syntax makes
every reply a valid call), its calls read back as `tool_calls` whole and streamed, reasoning split
into reasoning_content, and a GGUF file carrying a family's template naming its format in /props."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import httpx
import jsonschema
import pytest
from openai import OpenAI

from ember.server.state import mentions_tools
from ember.tokenizer.chat import ChatTemplate

from gguf_edit import rewrite
from test_server_harness import serve_model, smollm  # noqa: F401 (fixture)

TEMPLATES = Path(__file__).parent / "data" / "templates"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 10},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                                                "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the web",
                                           "parameters": {"type": "object", "properties": {
                                               "q": {"type": "string", "maxLength": 10}}, "required": ["q"]}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FAMILIES = {  # template: the format /props names
    "Qwen-Qwen3-0.6B": "hermes", "Qwen3-Coder": "qwen3-coder", "meta-llama-Llama-3.1-8B-Instruct": "llama3",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral", "mistralai-Mistral-Nemo-Instruct-2407": "mistral-nemo",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseek-r1", "deepseek-ai-DeepSeek-V3.1": "deepseek-v3.1",
    "openai-gpt-oss-120b": "gpt-oss", "GLM-4.6": "glm-4.5", "moonshotai-Kimi-K2": "kimi-k2",
    "meetkai-functionary-medium-v3.2": "functionary-v3.2", "ibm-granite-granite-3.3-2B-Instruct": "granite",
}


def post(url: str, **kwargs) -> httpx.Response:
    return httpx.post(url, timeout=120, **kwargs)


def with_template(model, name: str):
    """The loaded SmolLM2 with a family's template instead of its own (engine shared)."""
    text = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    base = model.chat_template
    template = ChatTemplate.from_string(text, f"file:{name}", base.bos_token, base.eos_token, base.add_bos,
                                        base.add_eos)
    return replace(model, chat_template=template, template_text=text, native_tools=mentions_tools(text))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, smollm):
    with serve_model(with_template(smollm, request.param)) as live:
        live.wait_ready()
        yield request.param, live


def client(live) -> OpenAI:
    return OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_props_name_the_format(family):
    name, live = family
    assert httpx.get(live.url + "/props").json()["chat_format"] == FAMILIES[name]


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # R1, V3.1 would open the reasoning first


def test_required_call_parsed(family):
    _, live = family
    r = client(live).chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                             max_tokens=200, temperature=0, extra_body=NO_THINKING)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        check_call(call.function.name, call.function.arguments)


def test_named_call_streamed(family):
    _, live = family
    stream = client(live).chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0, stream=True, extra_body=NO_THINKING,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    names, ids, args, content, finish = [], [], "", "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or ():
            if d.function.name:
                names.append(d.function.name)
                ids.append(d.id)
            args += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and ids[0] and finish == "tool_calls", (names, content)
    check_call("get_weather", args)
    assert not any(m in content for m in ("<tool_call", "[TOOL_CALLS", "<|channel", "tool▁call", "<function="))


def test_history_round_trip_renders(family):
    """A whole agent turn (call, result, answer) goes through /apply-template and a generation."""
    _, live = family
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'}]
    r = post(live.url + "/apply-template", json={"messages": history, "tools": TOOLS})
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert "get_weather" in prompt and "Paris" in prompt and '"temp": 21' in prompt.replace('\\"', '"')
    r = client(live).chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


# ---- reasoning ----

@pytest.fixture(scope="module")
def thinker(smollm):
    """R1's template, which opens the reasoning block in the prompt when thinking is on."""
    with serve_model(with_template(smollm, "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B")) as live:
        live.wait_ready()
        yield live


THINK = {"messages": ASK, "max_tokens": 12, "temperature": 0}  # thinking is on unless turned off


def test_reasoning_goes_to_reasoning_content(thinker):
    r = post(thinker.url + "/v1/chat/completions", json=THINK).json()
    message = r["choices"][0]["message"]
    assert message["reasoning_content"] and not message["content"]
    inline = post(thinker.url + "/v1/chat/completions", json={**THINK, "reasoning_format": "none"}).json()
    assert inline["choices"][0]["message"]["content"] == message["reasoning_content"].strip() or \
        inline["choices"][0]["message"]["content"].strip() == message["reasoning_content"]
    assert "reasoning_content" not in inline["choices"][0]["message"]


def test_reasoning_streams_as_reasoning_deltas(thinker):
    whole = post(thinker.url + "/v1/chat/completions", json=THINK).json()["choices"][0]["message"]
    stream = client(thinker).chat.completions.create(model="m", stream=True, messages=ASK, max_tokens=12,
                                                     temperature=0)
    reasoning = ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        assert not delta.content
    assert reasoning == whole["reasoning_content"]


def test_thinking_off_leaves_the_content(thinker):
    body = {**THINK, "chat_template_kwargs": {"enable_thinking": False}}
    message = post(thinker.url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["content"] and "reasoning_content" not in message


def test_reasoning_budget_forces_the_end_of_thinking(thinker, smollm):
    """Unbounded, SmolLM2 thinks through all 12 tokens; with a budget of 3 the marker is forced after
    3 tokens of reasoning and the rest is the answer."""
    body = {**THINK, "max_tokens": 16, "ignore_eos": True}
    free = post(thinker.url + "/v1/chat/completions", json=body).json()
    assert not free["choices"][0]["message"]["content"]
    capped = post(thinker.url + "/v1/chat/completions", json={**body, "reasoning_budget": 3}).json()
    message = capped["choices"][0]["message"]
    assert message["content"] and message["reasoning_content"]
    n_close = len(smollm.tokenizer.encode("</think>", add_special=False))
    assert capped["usage"]["completion_tokens"] == 16
    reasoning_ids = smollm.tokenizer.encode(message["reasoning_content"], add_special=False)
    assert len(reasoning_ids) <= 3 + 1 and n_close > 0  # 3 tokens (re-tokenized text may merge or split one)
    assert free["choices"][0]["message"]["reasoning_content"].startswith(message["reasoning_content"])


def test_forced_call_after_opened_reasoning(smollm):
    """Qwen3.5's prompt opens the reasoning: a required call comes after it (here cut short by reasoning_budget)."""
    with serve_model(with_template(smollm, "Qwen3.5-4B")) as live:
        live.wait_ready()
        r = post(live.url + "/v1/chat/completions", json={
            "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "temperature": 0,
            "reasoning_budget": 4}).json()
    message = r["choices"][0]["message"]
    assert message["reasoning_content"] and message["tool_calls"], message
    for call in message["tool_calls"]:
        check_call(call["function"]["name"], call["function"]["arguments"])


def test_reasoning_budget_zero_turns_thinking_off(thinker):
    message = post(thinker.url + "/v1/chat/completions", json={
        "messages": ASK, "max_tokens": 12, "temperature": 0, "reasoning_budget": 0}).json()["choices"][0]["message"]
    assert message["content"] and "reasoning_content" not in message


@pytest.mark.parametrize("field,value", [("reasoning_format", "loud"), ("reasoning_budget", -2),
                                         ("reasoning_budget", "many")])
def test_bad_reasoning_fields_are_400s(thinker, field, value):
    r = post(thinker.url + "/v1/chat/completions", json={**THINK, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


# ---- a GGUF file carrying a family's template ----

def test_a_gguf_with_a_family_template(smollm, tmp_path):
    from ember.app import load_model
    from test_server_harness import MODEL_CFG

    text = (TEMPLATES / "Qwen3-Coder.jinja").read_text(encoding="utf-8")
    path = rewrite(smollm.path, tmp_path / "coder.gguf", metadata={"tokenizer.chat_template": (text, "string")})
    model = load_model(replace(MODEL_CFG, model=str(path), slots=1))
    try:
        with serve_model(model) as live:
            live.wait_ready()
            assert httpx.get(live.url + "/props").json()["chat_format"] == "qwen3-coder"
            history = ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                              "function": {"name": "search", "arguments": '{"q": "rain"}'}}]}]
            prompt = post(live.url + "/apply-template", json={"messages": history, "tools": TOOLS}).json()["prompt"]
            tools = [{"type": "function", "function": {"name": t["function"]["name"], "description":
                      t["function"]["description"], "parameters": t["function"]["parameters"]}} for t in TOOLS]
            expected = ChatTemplate.from_string(text).render(
                [ASK[0], {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
                    "name": "search", "arguments": {"q": "rain"}}}]}], add_generation_prompt=True, tools=tools)
            assert prompt == expected and "<function=search>\n<parameter=q>\nrain\n</parameter>" in prompt
    finally:
        model.close()
        path.unlink()
