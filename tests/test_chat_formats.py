"""Each family's chat format without HTTP, on the real templates in tests/data/templates/: which
format a template is detected as, replies in each family's syntax read whole and streamed split at
every position, calls and results rendered into history the way the template renders them (and
read back: parse(render(calls)) == calls), and the grammars in each family's syntax (checked
against the real SmolLM2 vocabulary)."""
from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from ember.gbnf import Grammar, TokenVocab
from ember.server.core.formats import FAMILIES, FormatOutput, Reading, detect, thinking_opened
from ember.server.core.prompts import template_globals
from ember.server.core.replies import CallArguments, CallStart, Reasoning, Text, ToolCall
from ember.server.core.request import Message, Tool, ToolChoice, ToolSetup
from ember.server.state import mentions_tools
from ember.tokenizer.chat import ChatTemplate

from test_server_harness import smollm  # noqa: F401 (fixture)

TEMPLATES = Path(__file__).parent / "data" / "templates"
FORMATS = {f.name: f for f in FAMILIES}
TOOLS_ON = Reading(tools=True)

DETECTED = {
    "Qwen-Qwen2.5-7B-Instruct": "hermes", "Qwen-QwQ-32B": "hermes", "Qwen-Qwen3-0.6B": "hermes",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "hermes", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes",
    "ibm-granite-granite-4.0": "hermes", "Qwen3-Coder": "qwen3-coder", "Qwen3.5-4B": "qwen3-coder",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3", "meta-llama-Llama-3.2-3B-Instruct": "llama3",
    "meta-llama-Llama-3.3-70B-Instruct": "llama3", "mistralai-Mistral-Nemo-Instruct-2407": "mistral-nemo",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral", "unsloth-mistral-Devstral-Small-2507": "mistral",
    "mistralai-Ministral-3-14B-Reasoning-2512": "mistral-reasoning",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": "deepseek-r1", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseek-r1",
    "deepseek-ai-DeepSeek-V3.1": "deepseek-v3.1", "openai-gpt-oss-120b": "gpt-oss",
    "GLM-4.6": "glm-4.5", "moonshotai-Kimi-K2": "kimi-k2", "meetkai-functionary-medium-v3.2": "functionary-v3.2",
    "ibm-granite-granite-3.3-2B-Instruct": "granite",
    "google-gemma-2-2b-it": "generic", "microsoft-Phi-3.5-mini-instruct": "generic",
    "HuggingFaceTB-SmolLM3-3B": "generic",
}


def template_text(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def format_of(name: str):
    text = template_text(name)
    return detect(text, mentions_tools(text))


@pytest.mark.parametrize("name,expected", sorted(DETECTED.items()))
def test_detected_from_the_template(name, expected):
    assert format_of(name).name == expected


def test_plain_templates_keep_the_generic_protocol_and_find_think_markers():
    assert format_of("google-gemma-2-2b-it").think is None
    assert format_of("HuggingFaceTB-SmolLM3-3B").think == ("<think>", "</think>")


# ---- reading replies, whole and streamed ----

def stream(fmt, text: str, reading: Reading, cuts=()):
    """Deltas and the final reply of `text` fed in the pieces `cuts` makes."""
    out, deltas, last = FormatOutput(fmt, reading), [], 0
    for cut in (*cuts, len(text)):
        deltas += out.feed(text[last:cut])
        last = cut
    tail, reply = out.finish()
    return deltas + tail, reply


def assembled(deltas):
    """What a client assembles from the deltas: content, reasoning, [(name, arguments)]."""
    content = "".join(d.text for d in deltas if isinstance(d, Text))
    reasoning = "".join(d.text for d in deltas if isinstance(d, Reasoning))
    calls: dict[int, list] = {}
    for d in deltas:
        if isinstance(d, CallStart):
            assert d.index == len(calls) and d.index not in calls
            calls[d.index] = [d.name, ""]
        if isinstance(d, CallArguments):
            calls[d.index][1] += d.text
    return content, reasoning, [tuple(c) for c in calls.values()]


W, S = '{"city": "Paris"}', '{"q": "x y"}'
R1_CALLS = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n" + W +
            "\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n" + S +
            "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
CASES = [  # format, reply, reading, (content, reasoning, calls)
    ("hermes", "<think>\nThe user asks.\n</think>\n\nLet me look.\n<tool_call>\n"
               '{"name": "get_weather", "arguments": ' + W + '}\n</tool_call>\n<tool_call>\n{"name": "search", '
               '"arguments": ' + S + "}\n</tool_call>", TOOLS_ON,
     ("Let me look.", "The user asks.", [("get_weather", W), ("search", S)])),
    ("hermes", "Plain <tool text, no call.", TOOLS_ON, ("Plain <tool text, no call.", None, [])),
    ("hermes", "inside the thought</think>The answer.", Reading(tools=False, thinking=True),
     ("The answer.", "inside the thought", [])),
    ("hermes", "<think>kept</think>inline", Reading(split_reasoning=False), ("<think>kept</think>inline", None, [])),
    ("qwen3-coder", "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"unit\": \"C\"}\n</parameter>\n</function>\n"
                    "</tool_call>", TOOLS_ON,
     ("I will check.", None, [("get_weather", '{"city": "Paris", "days": 3, "opts": {"unit": "C"}}')])),
    ("qwen3-coder", "<think>\nhm\n</think>\n\n<tool_call>\n<function=search>\n<parameter=q>\nline 1\nline 2\n"
                    "</parameter>\n</function>\n</tool_call>", TOOLS_ON, (None, "hm", [("search", '{"q": "line 1\\nline 2"}')])),
    ("llama3", '{"name": "get_weather", "parameters": ' + W + "}", TOOLS_ON, (None, None, [("get_weather", W)])),
    ("llama3", '{"type": "function", "name": "search", "parameters": ' + S + "}", TOOLS_ON,
     (None, None, [("search", S)])),
    ("llama3", '<|python_tag|>brave_search.call(query="weather in Paris", count=3)', TOOLS_ON,
     (None, None, [("brave_search", '{"query": "weather in Paris", "count": 3}')])),
    ("llama3", 'The JSON {"answer": 42} is not a call.', TOOLS_ON, ('The JSON {"answer": 42} is not a call.', None, [])),
    ("mistral", "Checking.[TOOL_CALLS]get_weather[ARGS]" + W + "[TOOL_CALLS]search[ARGS]" + S, TOOLS_ON,
     ("Checking.", None, [("get_weather", W), ("search", S)])),
    ("mistral", "[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]" + W, TOOLS_ON, (None, None, [("get_weather", W)])),
    ("mistral", "[TOOL_CALLS] not [a call", TOOLS_ON, ("[TOOL_CALLS] not [a call", None, [])),
    ("mistral-nemo", '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + W + ', "id": "a1b2c3d4e"}, '
                     '{"name": "search", "arguments": ' + S + ', "id": "b1b2c3d4e"}]', TOOLS_ON,
     (None, None, [("get_weather", W), ("search", S)])),
    ("mistral-reasoning", "[THINK]Weather needed.[/THINK]On it.[TOOL_CALLS]get_weather[ARGS]" + W, TOOLS_ON,
     ("On it.", "Weather needed.", [("get_weather", W)])),
    ("deepseek-r1", "Two calls.\n</think>\n\n" + R1_CALLS, Reading(tools=True, thinking=True),
     (None, "Two calls.", [("get_weather", W), ("search", S)])),
    ("deepseek-r1", "<think>x</think>Sunny.", Reading(), ("Sunny.", "x", [])),
    ("deepseek-v3.1", "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" + W +
                      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", TOOLS_ON, ("Sure.", None, [("get_weather", W)])),
    ("glm-4.5", "<think>Look up.</think>\nChecking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", TOOLS_ON,
     ("Checking.", "Look up.", [("get_weather", '{"city": "Paris", "days": 3}')])),
    ("kimi-k2", "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                + W + "<|tool_call_end|><|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>" + S +
                "<|tool_call_end|><|tool_calls_section_end|>", TOOLS_ON,
     ("Sure.", None, [("get_weather", W), ("search", S)])),
    ("functionary-v3.2", "all\nLet me check.>>>get_weather\n" + W + ">>>search\n" + S, TOOLS_ON,
     ("Let me check.", None, [("get_weather", W), ("search", S)])),
    ("functionary-v3.2", "python\nprint(1 > 0)", TOOLS_ON, (None, None, [("python", '{"code": "print(1 > 0)"}')])),
    ("functionary-v3.2", "all\nJust > text.", Reading(), ("Just > text.", None, [])),
    ("granite", "<think>Plan.</think><response>Calling.</response><|tool_call|>[" + '{"name": "get_weather", '
                '"arguments": ' + W + "}]", TOOLS_ON, ("Calling.", "Plan.", [("get_weather", W)])),
    ("gpt-oss", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                "to=functions.get_weather <|constrain|>json<|message|>" + W + "<|call|>", TOOLS_ON,
     (None, "Need the weather.", [("get_weather", W)])),
    ("gpt-oss", "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant to=functions.search<|channel|>"
                "commentary json<|message|>" + S, TOOLS_ON, (None, "Think.", [("search", S)])),
    ("gpt-oss", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
                "It is sunny.<|return|>", Reading(), ("It is sunny.", "Easy.", [])),
]


@pytest.mark.parametrize("name,text,reading,expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_reply_read_whole_and_split_at_every_position(name, text, reading, expected):
    fmt = FORMATS[name]
    content, reasoning, calls = expected
    _, whole = stream(fmt, text, reading)
    assert (whole.content, whole.reasoning) == (content, reasoning)
    assert [(c.name, c.arguments) for c in whole.tool_calls] == calls
    for cut in range(1, len(text)):
        deltas, reply = stream(fmt, text, reading, (cut,))
        assert (reply.content, reply.reasoning, reply.tool_calls) == (content, reasoning, reply.tool_calls)
        got_content, got_reasoning, got_calls = assembled(deltas)
        assert got_content.strip() == (content or "") and got_reasoning == (reasoning or ""), cut
        assert got_calls == calls, cut
    deltas, _ = stream(fmt, text, reading, range(1, len(text)))  # one character at a time
    assert assembled(deltas)[2] == calls


@pytest.mark.parametrize("name,text,reading,expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_partial_markers_never_reach_the_content(name, text, reading, expected):
    """Fed a character at a time, the content sent so far is always the start of the final content."""
    out, sent = FormatOutput(FORMATS[name], reading), ""
    for ch in text:
        sent += "".join(d.text for d in out.feed(ch) if isinstance(d, Text))
        assert (expected[0] or "").startswith(sent.strip()), sent


def test_mistral_ids_are_nine_letters_and_digits():
    fmt = FORMATS["mistral"]
    _, reply = stream(fmt, "[TOOL_CALLS]search[ARGS]" + S, TOOLS_ON)
    assert len(reply.tool_calls[0].id) == 9 and reply.tool_calls[0].id.isalnum()
    assert fmt.call_id("call_0123456789abcdef") == fmt.call_id("call_0123456789abcdef")
    assert len(fmt.call_id("call_x")) == 9 and fmt.call_id("a1b2c3d4e") == "a1b2c3d4e"


def test_thinking_opened_by_the_prompt():
    assert thinking_opened("<｜Assistant｜><think>\n", ("<think>", "</think>"))
    assert not thinking_opened("<think>a</think>\n<|im_start|>assistant\n", ("<think>", "</think>"))
    assert not thinking_opened("anything", None)


# ---- history: calls and results rendered as the template renders them, and read back ----

WEATHER = Tool("get_weather", "Current weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]})
SEARCH = Tool("search", "Web search", {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]})
TOOLSET = ToolSetup((WEATHER, SEARCH), ToolChoice("auto"))
CALL_ARGS = [("get_weather", {"city": "Paris", "days": 2}), ("search", {"q": "rain"})]


def render(name: str, messages, add_generation_prompt: bool, **kwargs) -> str:
    fmt = format_of(name)
    msgs, extra = fmt.messages(tuple(messages), TOOLSET)
    template = ChatTemplate.from_string(template_text(name), name, "<s>", "</s>")
    return template.render(msgs, add_generation_prompt, **{**template_globals(), **kwargs, **extra})


def conversation(n_calls: int) -> list[Message]:
    calls = tuple(ToolCall(f"call_{i}", n, json.dumps(a)) for i, (n, a) in enumerate(CALL_ARGS[:n_calls]))
    return [Message("user", "Weather in Paris?"), Message("assistant", "", calls)]


FAMILY_TEMPLATES = sorted(n for n, f in DETECTED.items() if f != "generic")
ONE_CALL = {"openai-gpt-oss-120b", "meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct",
            "meta-llama-Llama-3.3-70B-Instruct"}  # their templates write one call per turn


@pytest.mark.parametrize("name", FAMILY_TEMPLATES)
def test_calls_rendered_in_history_read_back_as_the_same_calls(name):
    fmt = format_of(name)
    n = 1 if name in ONE_CALL else 2
    msgs = conversation(n)
    told = render(name, msgs, False)
    tail = told[told.index("Weather in Paris?") + len("Weather in Paris?"):]  # the assistant's turn and what leads to it
    _, reply = stream(fmt, tail, TOOLS_ON)
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == CALL_ARGS[:n], tail


@pytest.mark.parametrize("name", FAMILY_TEMPLATES)
def test_a_whole_agent_turn_renders(name):
    msgs = [*conversation(1), Message("tool", '{"temp": 21}', tool_call_id="call_0", name="get_weather"),
            Message("assistant", "It is 21 degrees.", reasoning="The tool said 21."),
            Message("user", "Thanks")]
    text = render(name, msgs, True)
    assert "Weather in Paris?" in text and '21' in text and "It is 21 degrees." in text
    assert "get_weather" in text


def test_golden_prompts():
    msgs = [*conversation(1), Message("tool", '{"temp": 21}', tool_call_id="call_0", name="get_weather")]
    qwen = render("Qwen3-Coder", msgs, True)
    assert qwen.endswith("<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                         "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
                         "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<|im_end|>\n"
                         "<|im_start|>assistant\n")
    mistral = render("Mistral-Small-3.2-24B-Instruct-2506", msgs, True)
    call_id = FORMATS["mistral"].call_id("call_0")
    assert f'[TOOL_CALLS]get_weather[CALL_ID]{call_id}[ARGS]{{"city": "Paris", "days": 2}}</s>' \
           f'[TOOL_RESULTS]{call_id}[TOOL_CONTENT]{{"temp": 21}}[/TOOL_RESULTS]' in mistral
    oss = render("openai-gpt-oss-120b", [*conversation(1)[:1], Message("assistant", "", conversation(1)[1].tool_calls,
                                                                       reasoning="I should look it up.")], True)
    assert "<|start|>assistant<|channel|>analysis<|message|>I should look it up.<|end|><|start|>assistant " \
           "to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\", \"days\": 2}<|call|>" in oss
    llama = render("meta-llama-Llama-3.1-8B-Instruct", conversation(1), False)
    assert '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": ' \
           '{"city": "Paris", "days": 2}}<|eot_id|>' in llama


LLAMA_SERVER = json.loads((Path(__file__).parent / "data" / "llama_server_prompts.json").read_text(encoding="utf-8"))
DELIBERATE = {  # where ember renders a conversation differently from llama-server, and why
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": "llama-server passes a null content as \"\", so this template "
                                                "drops the call; ember passes null and the call is written",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "llama-server's \"\" content adds an empty assistant turn after the call",
    "ibm-granite-granite-3.3-2B-Instruct": "the template writes no tool_calls; ember puts them in the content as "
                                           "<|tool_call|>[...], the syntax the model answers in",
}


@pytest.mark.parametrize("name", sorted(LLAMA_SERVER["prompts"]))
def test_history_renders_as_llama_server_renders_it(name, smollm):
    """A call, its result and the generation prompt, through each template: the prompt llama-server
    wrote for the same request (tests/data/llama_server_prompts.json), dates aside."""
    body, fmt = LLAMA_SERVER["body"], format_of(name)
    tool = body["tools"][0]["function"]
    setup = ToolSetup((Tool(tool["name"], tool["description"], tool["parameters"]),), ToolChoice("auto"))
    call = body["messages"][1]["tool_calls"][0]
    msgs = (Message("user", body["messages"][0]["content"]),
            Message("assistant", "", (ToolCall(call["id"], call["function"]["name"], call["function"]["arguments"]),)),
            Message("tool", body["messages"][2]["content"], tool_call_id=call["id"], name="get_weather"))
    messages, extra = fmt.messages(msgs, setup)
    base = smollm.chat_template
    template = ChatTemplate.from_string(template_text(name), name, base.bos_token, base.eos_token)
    ours = template.render(messages, True, **{**template_globals(), **extra})
    recorded = datetime.date.fromisoformat(LLAMA_SERVER["recorded"])
    for day in (datetime.date.today(), datetime.datetime.now(datetime.timezone.utc).date()):
        for form in ("%Y-%m-%d", "%d %b %Y"):
            ours = ours.replace(day.strftime(form), recorded.strftime(form))
    if name in DELIBERATE:
        assert ours != LLAMA_SERVER["prompts"][name] and "get_weather" in ours, DELIBERATE[name]
    else:
        assert ours == LLAMA_SERVER["prompts"][name]


def test_earlier_reasoning_is_dropped_or_kept_as_the_template_says():
    msgs = [Message("user", "a"), Message("assistant", "b", reasoning="secret thought"), Message("user", "c")]
    assert "secret thought" not in render("Qwen-Qwen3-0.6B", msgs, True)  # Qwen3 drops earlier turns' reasoning
    ministral = render("mistralai-Ministral-3-14B-Reasoning-2512", msgs, True)
    assert "[THINK]secret thought[/THINK]b" in ministral


def test_thinking_switch_reaches_the_template():
    on = render("Qwen3.5-4B", [Message("user", "a")], True)
    off = render("Qwen3.5-4B", [Message("user", "a")], True, enable_thinking=False)
    fmt = format_of("Qwen3.5-4B")
    assert thinking_opened(on, fmt.think) and not thinking_opened(off, fmt.think)


# ---- grammars in each family's syntax ----

@pytest.fixture(scope="module")
def vocab(smollm):
    return TokenVocab.for_tokenizer(smollm.tokenizer)


def accepts(spec, vocab, text: str) -> bool:
    matcher = Grammar.parse(spec.gbnf, root=spec.root).compile(vocab).matcher(spec.lazy_triggers or None)
    return matcher.accept_text(text) and matcher.can_end


def setup(mode: str, name=None, parallel=False) -> ToolSetup:
    return ToolSetup((WEATHER, SEARCH), ToolChoice(mode, name), parallel)


GOOD = {  # format: (a call of get_weather, a call of search) as the grammar writes them
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
               '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'),
    "qwen3-coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
                    "</parameter>\n</function>\n</tool_call>",
                    "<tool_call>\n<function=search>\n<parameter=q>\nx <b>\n</parameter>\n</function>\n</tool_call>"),
    "llama3": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', '{"name": "search", "parameters": {"q": "x"}}'),
    "mistral": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', '[TOOL_CALLS]search[ARGS]{"q": "x"}'),
    "deepseek-r1": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n"
                    '{"q": "x"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "deepseek-v3.1": ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                      '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{"q": "x"}'
                      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "gpt-oss": ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
                '<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.search <|constrain|>json<|message|>{"q": "x"}<|call|>'),
}
GOOD["glm-4.5"] = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                   "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
                   "<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>x</arg_value>\n</tool_call>")
GOOD["kimi-k2"] = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                   '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
                   "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>"
                   '{"q": "x"}<|tool_call_end|><|tool_calls_section_end|>')
GOOD["functionary-v3.2"] = ('get_weather\n{"city": "Paris"}', 'search\n{"q": "x"}')
GOOD["granite"] = ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                   '<|tool_call|>[{"name": "search", "arguments": {"q": "x"}}]')
GOOD["mistral-nemo"] = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]',
                        '[TOOL_CALLS][{"name": "search", "arguments": {"q": "x"}, "id": "Zz9Zz9Zz9"}]')
@pytest.mark.parametrize("name", sorted(GOOD))
def test_family_grammar_required_named_and_auto(name, vocab):
    fmt = FORMATS[name]
    weather, search = GOOD[name]
    required, named = fmt.grammar(setup("required")), fmt.grammar(setup("function", "get_weather"))
    assert accepts(required, vocab, weather) and accepts(required, vocab, search)
    assert not accepts(required, vocab, "Just text.") and not accepts(required, vocab, "x" + weather)
    assert accepts(named, vocab, weather.replace("Paris", "Rome"))
    assert not accepts(named, vocab, search)
    bad = weather.replace("<parameter=city>", "<parameter=town>").replace("<arg_key>city", "<arg_key>town") \
        .replace('{"city"', '{"town"')
    assert not accepts(required, vocab, bad)
    auto = fmt.grammar(setup("auto"))
    if name == "functionary-v3.2":  # the first line chooses: no lazy start
        assert accepts(auto, vocab, "all\nNo call at all.") and accepts(auto, vocab, "all\nLet me see.>>>" + weather)
        assert accepts(auto, vocab, weather) and not accepts(auto, vocab, bad) and not auto.lazy_triggers
    else:
        assert auto.lazy_triggers and accepts(auto, vocab, "No call at all.")
        assert accepts(auto, vocab, "Let me see. " + weather)
        assert not accepts(auto, vocab, "Let me see. " + bad)
    assert fmt.grammar(setup("none")) is None


@pytest.mark.parametrize("name", ["hermes", "qwen3-coder", "deepseek-r1", "glm-4.5"])
def test_forced_call_after_reasoning_the_prompt_opened(name, vocab):
    """A prompt that opens the reasoning (Qwen3.5, R1) lets the model finish it before the forced call."""
    fmt = FORMATS[name]
    weather = GOOD[name][0]
    spec = fmt.grammar(setup("required"), thinking=True)
    text = "Rain or sun? </no> <th\nthink" + fmt.think[1] + "\n\n" + weather
    assert accepts(spec, vocab, text) and not accepts(spec, vocab, "x" + fmt.think[1] + "\nplain text")
    _, reply = stream(fmt, text, Reading(tools=True, thinking=True))
    assert reply.reasoning == "Rain or sun? </no> <th\nthink" and [c.name for c in reply.tool_calls] == ["get_weather"]


def test_harmony_recipient_before_the_channel(vocab):
    auto = FORMATS["gpt-oss"].grammar(setup("auto"))
    text = '<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant to=functions.search<|channel|>commentary ' \
           '<|constrain|> json<|message|>{"q": "x"}<|call|>'
    assert accepts(auto, vocab, text)
    assert [c.name for c in stream(FORMATS["gpt-oss"], text, TOOLS_ON)[1].tool_calls] == ["search"]


@pytest.mark.parametrize("name", ["hermes", "qwen3-coder", "mistral", "mistral-nemo", "deepseek-r1", "deepseek-v3.1",
                                  "glm-4.5", "kimi-k2", "functionary-v3.2", "granite"])
def test_family_grammar_parallel_calls(name, vocab):
    fmt = FORMATS[name]
    weather, search = GOOD[name]
    one, many = fmt.grammar(setup("required")), fmt.grammar(setup("required", parallel=True))
    if name == "mistral-nemo":
        both = weather[:-1] + ", " + search[len("[TOOL_CALLS]["):]
    elif name.startswith("deepseek"):
        both = weather.removesuffix("<｜tool▁calls▁end｜>") + search.removeprefix("<｜tool▁calls▁begin｜>")
    elif name == "kimi-k2":
        both = weather.removesuffix("<|tool_calls_section_end|>") + search.removeprefix("<|tool_calls_section_begin|>")
    elif name == "mistral":
        both = weather + search
    elif name == "functionary-v3.2":
        both = weather + ">>>" + search
    elif name == "granite":
        both = weather[:-1] + ", " + search[len("<|tool_call|>["):]
    else:
        both = weather + "\n" + search
    assert accepts(many, vocab, both) and not accepts(one, vocab, both)
    _, reply = stream(fmt, both, TOOLS_ON)
    assert [c.name for c in reply.tool_calls] == ["get_weather", "search"]


@pytest.mark.parametrize("name", sorted(GOOD))
def test_what_the_grammar_accepts_reads_back_as_calls(name):
    for text, tool in zip(GOOD[name], ("get_weather", "search")):
        _, reply = stream(FORMATS[name], text, TOOLS_ON)
        assert [c.name for c in reply.tool_calls] == [tool]
