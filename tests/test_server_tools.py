"""The tool-call protocol without HTTP: reading JSON that is still being generated, turning
generated text into deltas and replies, and the grammars that enforce calls (checked
against the real SmolLM2 vocabulary)."""
from __future__ import annotations

import json

import pytest

from ember.gbnf import Grammar, TokenVocab
from ember.server.errors import APIError
from ember.server.fields import Fields
from ember.server.core.jsonscan import Incomplete, string_prefix, value_end
from ember.server.core.replies import CallArguments, CallStart, EnvelopeOutput, TaggedOutput, Text
from ember.server.core.request import Tool, ToolChoice, ToolSetup
from ember.server.core.tools import GenericProtocol, TaggedProtocol
from ember.server.openai.messages import parse_tools

from test_server_harness import smollm  # noqa: F401 (fixture)

WEATHER = Tool("get_weather", "weather", {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string"}, "at": {"$ref": "#/$defs/point"}},
    "$defs": {"point": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}}})
SEARCH = Tool("search", "search", {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]})


def stream(output, text: str, step: int = 1):
    """Feed `text` in pieces of `step` characters; the deltas and the final reply."""
    deltas = []
    for i in range(0, len(text), step):
        deltas += output.feed(text[i:i + step])
    tail, reply = output.finish()
    return deltas + tail, reply


def joined(deltas, index: int) -> tuple[str | None, str]:
    """A streamed call's name and its argument text, as a client would assemble them."""
    name, args = None, ""
    for d in deltas:
        if isinstance(d, CallStart) and d.index == index:
            name = d.name
        if isinstance(d, CallArguments) and d.index == index:
            args += d.text
    return name, args


def content(deltas) -> str:
    return "".join(d.text for d in deltas if isinstance(d, Text))


# ---- partial JSON ----

@pytest.mark.parametrize("text,expected", [
    ('"abc', "abc"), ('"a\\', "a"), ('"a\\u00', "a"), ('"a\\u00e9', "aé"), ('"a\\"b', 'a"b'),
    ('"\\ud83d\\ude00x', "😀x"), ('"x\\ud83d', "x"), ('"x\\ud83d\\u', "x"), ('"\\\\u12', "\\u12"), ('"', ""),
])
def test_string_prefix_stops_before_half_escapes(text, expected):
    assert string_prefix(text, 0) == (expected, None)


def test_string_prefix_complete():
    assert string_prefix('"a\\nb", 1', 0) == ("a\nb", 6)


@pytest.mark.parametrize("text", ["{", '{"a": [1, 2', '{"a": 1', "12", "tru", '"ab'])
def test_value_end_incomplete(text):
    with pytest.raises(Incomplete):
        value_end(text, 0)


def test_value_end_complete():
    assert value_end('{"a": [1, "}"]} tail', 0) == 15
    assert value_end("12,", 0) == 2


# ---- reading generated text ----

@pytest.mark.parametrize("step", [1, 3, 1000])
def test_envelope_call_streams_like_the_whole(step):
    text = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Z\\u00fcrich", "at": {"lat": 47.4}}}}'
    deltas, reply = stream(EnvelopeOutput(), text, step)
    (call,) = reply.tool_calls
    assert reply.content is None and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Zürich", "at": {"lat": 47.4}}
    assert joined(deltas, 0) == ("get_weather", call.arguments)
    headers = [d for d in deltas if isinstance(d, CallStart)]
    assert len(headers) == 1 and headers[0].id == call.id and not any(isinstance(d, Text) for d in deltas)


def test_envelope_parallel_calls():
    text = ('{"tool_calls": [{"name": "search", "arguments": {"q": "a"}},\n  {"name": "get_weather", '
            '"arguments": {"city": "b"}}]}')
    deltas, reply = stream(EnvelopeOutput(), text)
    assert [c.name for c in reply.tool_calls] == ["search", "get_weather"]
    assert joined(deltas, 1) == ("get_weather", '{"city": "b"}')
    assert len({c.id for c in reply.tool_calls}) == 2


def test_envelope_response_streams_decoded_text():
    deltas, reply = stream(EnvelopeOutput(), '{"response": "He said \\"hi\\" \\ud83d\\ude00\\nbye"}')
    assert reply.content == 'He said "hi" 😀\nbye' and not reply.tool_calls
    assert content(deltas) == reply.content


def test_envelope_cut_short():
    _, reply = stream(EnvelopeOutput(), '{"response": "unfinish')
    assert reply.content == "unfinish"
    _, reply = stream(EnvelopeOutput(), '{"tool_call": {"name": "search", "arguments": {"q": "ab')
    assert reply.tool_calls == [] and reply.content.startswith('{"tool_call"')


def test_tagged_output_content_and_calls():
    text = 'Let me check <tool_ Paris.\n<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_weather", "arguments": {"city": "y"}}</tool_call>'
    deltas, reply = stream(TaggedOutput(), text)
    assert reply.content == "Let me check <tool_ Paris."
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("search", {"q": "x"}),
                                                                             ("get_weather", {"city": "y"})]
    streamed = content(deltas)
    assert streamed.strip() == reply.content and "<tool_call>" not in streamed


def test_tagged_output_holds_back_a_partial_tag():
    out = TaggedOutput()
    assert out.feed("Hello <tool") == [Text("Hello ")]
    assert out.feed("box>") == [Text("<toolbox>")]


# ---- grammars ----

@pytest.fixture(scope="module")
def vocab(smollm):
    return TokenVocab.for_tokenizer(smollm.tokenizer)


def accepts(spec, vocab, text: str) -> bool:
    matcher = Grammar.parse(spec.gbnf, root=spec.root).compile(vocab).matcher(spec.lazy_triggers or None)
    return matcher.accept_text(text) and matcher.can_end


def setup(mode: str, name=None, parallel=False) -> ToolSetup:
    return ToolSetup((WEATHER, SEARCH), ToolChoice(mode, name), parallel)


def test_generic_grammar_enforces_the_call_shape(vocab):
    call = '{"tool_call": {"name": "get_weather", "arguments": {"city": "x", "at": {"lat": 1.5}}}}'
    bad_args = '{"tool_call": {"name": "get_weather", "arguments": {"town": "x"}}}'
    other = '{"tool_call": {"name": "search", "arguments": {"q": "x"}}}'
    answer = '{"response": "no tool needed"}'
    required, named, auto = (GenericProtocol().grammar(s) for s in
                             (setup("required"), setup("function", "get_weather"), setup("auto")))
    assert accepts(required, vocab, call) and accepts(required, vocab, other)
    assert not accepts(required, vocab, answer) and not accepts(required, vocab, bad_args)
    assert accepts(named, vocab, call) and not accepts(named, vocab, other)
    assert accepts(auto, vocab, answer) and accepts(auto, vocab, call) and not accepts(auto, vocab, "plain text")
    parallel = GenericProtocol().grammar(setup("required", parallel=True))
    assert accepts(parallel, vocab, '{"tool_calls": [' + other[14:-1] + ", " + call[14:-1] + "]}")
    assert GenericProtocol().grammar(setup("none")) is None


def test_tagged_grammar_is_lazy_for_auto(vocab):
    block = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'
    auto = TaggedProtocol().grammar(setup("auto"))
    assert auto.lazy_triggers == ("<tool_call>",)
    assert accepts(auto, vocab, "Some text first. " + block)
    assert accepts(auto, vocab, "No call at all.")
    assert not accepts(auto, vocab, 'Text <tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    required = TaggedProtocol().grammar(setup("required"))
    assert accepts(required, vocab, block) and not accepts(required, vocab, "text " + block)


# ---- request parsing ----

def tool_json(name="f", params=None) -> dict:
    fn = {"name": name} if params is None else {"name": name, "parameters": params}
    return {"type": "function", "function": fn}


def test_parse_tools_defaults():
    s = parse_tools(Fields({"tools": [tool_json()]}))
    assert s.choice == ToolChoice("auto") and s.active and s.parallel is False
    assert s.tools[0].parameters == {"type": "object", "properties": {}}
    assert parse_tools(Fields({})).active is False
    assert parse_tools(Fields({"tools": [tool_json()], "tool_choice": "none"})).active is False


@pytest.mark.parametrize("body,param", [
    ({"tools": "f"}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [tool_json("x" * 65)]}, "tools[0].function.name"),
    ({"tools": [tool_json(params=[1])]}, "tools[0].function.parameters"),
    ({"tools": [tool_json(params={"$ref": "http://example.com/s.json"})]}, "tools[0].function.parameters"),
    ({"tools": [tool_json()], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [tool_json()], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_parse_tools_errors_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        parse_tools(Fields(body))
    assert e.value.status == 400 and e.value.param == param
