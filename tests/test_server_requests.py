"""The server's typed requests without a model or HTTP: bodies parsed into them (against plain
Limits), the invariants they check on construction, and the floors' imports running one way
(the APIs over the core, parsing apart from running)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ember.sampler import SamplingParams
from ember.server.core.replies import ToolCall
from ember.server.core.request import (Chat, Constraint, Generation, Limits, Message, Prompts, Tool, ToolChoice,
                                       ToolSetup)
from ember.server.errors import APIError
from ember.server.fields import Fields
from ember.server.llamacpp.request import parse_completion as parse_native, parse_detokenize
from ember.server.openai.request import parse_chat, parse_completion

LIMITS = Limits(n_vocab=100, n_ctx=64, max_sequences=4, max_stop=2, n_predict=-1, sampling=(("top_k", 5),))
ASK = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
SERVER = Path(__file__).resolve().parents[1] / "ember" / "server"


def refused(parse, body: dict, limits: Limits = LIMITS) -> APIError:
    with pytest.raises(APIError) as e:
        parse(Fields(body), limits)
    assert e.value.status == 400
    return e.value


# ---- bodies -> typed requests ----

def test_a_chat_body_becomes_one_typed_request():
    body = {"messages": [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text",
                                                                                                "text": "brief."}]},
                         *ASK, {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "function": {"name": "f", "arguments": {"a": 1}}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "2"}],
            "tools": [TOOL], "max_completion_tokens": 9, "max_tokens": 3, "n": 2, "stop": ["\n", ""], "temp": 0.5,
            "logprobs": True, "top_logprobs": 3, "stream": True, "stream_options": {"include_usage": True}}
    req = parse_chat(Fields(body), LIMITS)
    gen = req.gen
    assert req.stream and req.include_usage
    assert (gen.max_tokens, gen.n, gen.stop, gen.logprobs, gen.constraint) == (9, 2, ("\n",), 3, None)
    assert gen.sampling.temperature == 0.5 and gen.sampling.top_k == 5  # the server's default fills in
    chat = gen.prompt
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.messages[0].content == "Be brief." and chat.messages[3].tool_call_id == "c1"
    assert chat.messages[2].tool_calls == (ToolCall("c1", "f", '{"a": 1}'),)
    assert chat.tools.active and chat.tools.choice == ToolChoice("auto")
    assert chat.add_generation_prompt and not chat.continue_final


def test_a_final_assistant_message_is_continued():
    chat = parse_chat(Fields({"messages": [*ASK, {"role": "assistant", "content": "Hel"}]}), LIMITS).gen.prompt
    assert chat.continue_final and not chat.add_generation_prompt


def test_the_server_defaults_apply():
    gen = parse_chat(Fields({"messages": ASK}), LIMITS).gen
    assert gen.max_tokens == 64 and gen.n == 1 and gen.sampling == SamplingParams(top_k=5)  # -1: the context
    assert parse_chat(Fields({"messages": ASK}), Limits(100, 64, n_predict=7)).gen.max_tokens == 7
    assert parse_chat(Fields({"messages": ASK, "top_k": 2}), LIMITS).gen.sampling.top_k == 2


def test_completion_prompts_keep_text_and_ids_in_order():
    gen = parse_completion(Fields({"prompt": ["a", [1, "b", 2], {"prompt_string": "c"}], "max_tokens": 2}),
                           LIMITS).gen
    assert gen.prompt == Prompts((("a",), (1, "b", 2), ("c",)), ("prompt[0]", "prompt[1]", "prompt[2]"))
    native = parse_native(Fields({"prompt": [5, "x"], "n_predict": -1, "json_schema": {"type": "integer"},
                                  "return_tokens": True, "response_fields": "content"}), LIMITS)
    assert native.gen.prompt == Prompts(((5, "x"),), ("prompt",)) and native.gen.max_tokens == 64
    assert native.gen.constraint.param == "json_schema" and "root" in native.gen.constraint.grammar.gbnf
    assert native.return_tokens and native.fields == ("content",)


@pytest.mark.parametrize("parse,body,param,code", [
    (parse_chat, {"messages": ASK, "n": 5}, "n", "invalid_value"),  # max_sequences
    (parse_chat, {"messages": ASK, "stop": ["a", "b", "c"]}, "stop", "invalid_value"),  # max_stop
    (parse_chat, {"messages": ASK, "logit_bias": {"100": 1}}, "logit_bias", "invalid_value"),  # n_vocab
    (parse_chat, {"messages": ASK, "temperature": "x", "n": 0}, "n", "invalid_value"),  # in the body's order
    (parse_chat, {"messages": ASK, "tools": [TOOL], "json_schema": {}}, "json_schema", "conflicting_fields"),
    (parse_chat, {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"schema": 1}}},
     "response_format.json_schema.schema", "invalid_type"),
    (parse_completion, {"prompt": ["a", [1, 100]]}, "prompt[1][1]", "invalid_token"),
    (parse_completion, {"prompt": ["a"] * 3, "n": 2}, "prompt", "too_many_sequences"),
    (parse_native, {"prompt": ["a", "b"], "stream": True}, "prompt", "unsupported"),
    (parse_detokenize, {"tokens": [1, 100]}, "tokens[1]", "invalid_token"),
])
def test_mistakes_name_the_field(parse, body, param, code):
    err = refused(parse, body)
    assert (err.param, err.code) == (param, code)


def test_a_response_format_grammar_is_named_by_its_field():
    fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "string"}}}
    assert parse_chat(Fields({"messages": ASK, "response_format": fmt}), LIMITS).gen.constraint.param == \
        "response_format"
    err = refused(parse_chat, {"messages": ASK, "response_format": fmt, "grammar": 'root ::= "a"'})
    assert err.param == "grammar" and err.message == "give only one of response_format, grammar"


# ---- invariants checked on construction ----

CHAT = Chat((Message("user", "Hi"),))


@pytest.mark.parametrize("make", [
    lambda: Message("robot"),
    lambda: Message("user", "x", (ToolCall("c", "f", "{}"),)),
    lambda: Tool("bad name", "", {}),
    lambda: Tool("f", "", []),
    lambda: ToolChoice("function"),
    lambda: ToolChoice("always"),
    lambda: ToolSetup((Tool("f", "", {}), Tool("f", "", {}))),
    lambda: ToolSetup((Tool("f", "", {}),), ToolChoice("function", "g")),
    lambda: ToolSetup((), ToolChoice("auto")),
    lambda: Chat(()),
    lambda: Chat((Message("user", "Hi"),), continue_final=True, add_generation_prompt=False),
    lambda: Chat((Message("assistant", "Hi"),), continue_final=True),
    lambda: Chat((Message("assistant", "Hi"),), ToolSetup((Tool("f", "", {}),), ToolChoice("auto")),
                 add_generation_prompt=False, continue_final=True),
    lambda: Prompts((), ()),
    lambda: Prompts((("a",),), ("p", "q")),
    lambda: Prompts(((True,),), ("p",)),
    lambda: Generation(CHAT, max_tokens=-1),
    lambda: Generation(CHAT, max_tokens=1, n=0),
    lambda: Generation(CHAT, max_tokens=1, stop=("",)),
    lambda: Generation(Chat((Message("user", "Hi"),), ToolSetup((Tool("f", "", {}),), ToolChoice("required"))),
                       max_tokens=1, constraint=Constraint.json_object("response_format")),
])
def test_broken_requests_cannot_be_built(make):
    with pytest.raises(ValueError):
        make()


def test_limits():
    assert [LIMITS.max_tokens(v) for v in (None, -1, 0, 9)] == [64, 64, 0, 9]
    assert Limits(10, 64, n_predict=5).max_tokens(None) == 5
    assert LIMITS.check_token(99, "p") == 99
    with pytest.raises(APIError, match="outside the vocabulary"):
        LIMITS.check_token(100, "p")
    spelled = Limits(10, 64, sampling=(("temperature", 0.1),)).sampling_params({"temp": 0.9})
    assert spelled.temperature == 0.9  # the request's own spelling wins over the server's default
    with pytest.raises(APIError) as e:
        LIMITS.sampling_params({"top_p": 0.5, "min_p": 7})
    assert e.value.param == "min_p"


# ---- floors ----

def imports(module: Path) -> set[str]:
    """ember.server modules `module` imports, as paths below ember/server ("core/run")."""
    package = module.parent.relative_to(SERVER).parts
    out = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom) and 0 < node.level <= len(package) + 1:  # within ember.server
            base = list(package[:len(package) - node.level + 1])
            target = base + (node.module.split(".") if node.module else [])
            names = [target + [a.name] for a in node.names] if not node.module else [target]
            out.update("/".join(t) for t in names)
    return out


def test_the_floors_import_one_way():
    """The core knows no API and no HTTP glue; parsing runs nothing; the APIs share only
    openai's body vocabulary (llama-server's bodies extend OpenAI's)."""
    core = {p for p in SERVER.glob("core/*.py")}
    for module in core:
        assert not {m for m in imports(module) if m.split("/")[0] in ("openai", "llamacpp", "exchange")}, module
    for api in ("openai", "llamacpp"):
        for name in ("request.py", "body.py", "messages.py"):
            module = SERVER / api / name
            if module.exists():
                assert not imports(module) & {"core/run", "core/prompts", "core/tools", "exchange"}, module
    llama = set().union(*(imports(p) for p in SERVER.glob("llamacpp/*.py")))
    assert {m for m in llama if m.startswith("openai/")} <= {"openai/body", "openai/messages"}
    openai = set().union(*(imports(p) for p in SERVER.glob("openai/*.py")))
    assert {m for m in openai if m.startswith("llamacpp/")} <= {"llamacpp/reply"}
