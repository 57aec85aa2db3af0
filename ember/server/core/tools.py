"""Tool calls: how tools reach the prompt, how the grammar holds the model to a call, and how
calls are read back out of the generated text (whole, or as streaming deltas).

Two protocols:

generic (templates that do not render `tools`: SmolLM2, Gemma 3, most small models)
  The tools are described in the system message as JSON lines (name, description, JSON
  Schema of the arguments). The model answers with one JSON object, either
      {"tool_call": {"name": "<tool>", "arguments": {...}}}
  (with parallel_tool_calls: {"tool_calls": [{"name": ..., "arguments": ...}, ...]}) or
      {"response": "<text for the user>"}
  and a grammar built from those shapes (through the JSON Schema converter, so the
  arguments always validate against the tool's parameters) enforces it: `auto` allows
  both shapes, `required` only calls, a named function only a call of that function.
  Earlier calls and results in the conversation are written in the same JSON shapes
  (a tool result is a user message {"tool_result": {"name", "content"}}).

tagged (templates that render `tools` themselves, e.g. Hermes/Qwen style)
  The template formats the tools and the conversation; a call is
      <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>
  anywhere in the reply. `required`/named: the grammar makes the reply exactly such
  block(s); `auto`: the grammar switches on at the first "<tool_call>" (a lazy grammar).

tool_choice "none" describes no tools and applies no grammar.
"""
from __future__ import annotations

import json
from functools import lru_cache

from ...engine.engine import GrammarSpec
from ...gbnf.schema import schema_to_gbnf
from .replies import CLOSE_TAG, OPEN_TAG, EnvelopeOutput, Output, PlainOutput, TaggedOutput
from .request import Message, Tool, ToolChoice, ToolSetup


# ---- schemas of a call ----

def _rebased(schema, prefix: str):
    """A copy of `schema` whose local $refs point below `prefix` (it moves into $defs)."""
    if isinstance(schema, dict):
        return {k: (prefix + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else _rebased(v, prefix)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebased(v, prefix) for v in schema]
    return schema


def _calls_schema(setup: ToolSetup) -> tuple[dict, dict]:
    """($defs holding each tool's arguments schema, the schema of one allowed call)."""
    defs, calls = {}, []
    for i, tool in enumerate(setup.tools):
        if setup.choice.mode == "function" and tool.name != setup.choice.name:
            continue
        ref = f"#/$defs/args-{i}"
        defs[f"args-{i}"] = _rebased(tool.parameters, ref)
        calls.append({"type": "object", "required": ["name", "arguments"],
                      "properties": {"name": {"const": tool.name}, "arguments": {"$ref": ref}}})
    return defs, calls[0] if len(calls) == 1 else {"anyOf": calls}


def _envelope_schema(setup: ToolSetup) -> dict:
    defs, call = _calls_schema(setup)
    if setup.parallel:
        shape = {"type": "object", "required": ["tool_calls"],
                 "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}}}
    else:
        shape = {"type": "object", "required": ["tool_call"], "properties": {"tool_call": call}}
    options = [shape]
    if setup.choice.mode == "auto":
        options.append({"type": "object", "required": ["response"], "properties": {"response": {"type": "string"}}})
    return {"$defs": defs, "anyOf": options}


def _setup_key(setup: ToolSetup) -> str:
    """What the grammar depends on, as a hashable cache key (key order kept: it is the order
    the grammar writes properties in)."""
    return json.dumps({"tools": [[t.name, t.parameters] for t in setup.tools], "mode": setup.choice.mode,
                       "name": setup.choice.name, "parallel": setup.parallel})


def _from_key(key: str) -> ToolSetup:
    d = json.loads(key)
    return ToolSetup(tuple(Tool(n, "", p) for n, p in d["tools"]), ToolChoice(d["mode"], d["name"]), d["parallel"])


@lru_cache(maxsize=64)
def _generic_gbnf(key: str) -> str:
    return schema_to_gbnf(_envelope_schema(_from_key(key)))


BLOCK_RULE = "ToolCallBlock"  # upper case: the converter's rule names are lower case


@lru_cache(maxsize=64)
def _tagged_gbnf(key: str) -> str:
    setup = _from_key(key)
    defs, call = _calls_schema(setup)
    inner = schema_to_gbnf({"$defs": defs, **call}, root="call")
    repeat = ' ( "\\n" ToolCallOne )*' if setup.parallel else ""
    return (inner + f'{BLOCK_RULE} ::= ToolCallOne{repeat}\n'
            f'ToolCallOne ::= "{OPEN_TAG}" "\\n"? call "\\n"? "{CLOSE_TAG}"\n')


# ---- protocols ----

class GenericProtocol:
    """Tools described in the system message, replies as one JSON object (see module doc)."""

    name = "generic"

    def messages(self, messages: tuple[Message, ...], setup: ToolSetup) -> tuple[list[dict], dict]:
        """Template-ready messages (plain role/content strings) and extra template arguments."""
        names = _call_names(messages)
        out = [_generic_message(m, names, setup.active) for m in messages]
        if setup.active:
            out = _with_system_text(out, generic_instructions(setup))
        return out, {}

    def grammar(self, setup: ToolSetup) -> GrammarSpec | None:
        if not setup.active:
            return None
        return GrammarSpec(_generic_gbnf(_setup_key(setup)))

    def output(self, setup: ToolSetup) -> Output:
        return EnvelopeOutput() if setup.active else PlainOutput()


class TaggedProtocol:
    """The template renders the tools; calls are <tool_call>{...}</tool_call> blocks."""

    name = "tagged"

    def messages(self, messages: tuple[Message, ...], setup: ToolSetup) -> tuple[list[dict], dict]:
        out = [_tagged_message(m) for m in messages]
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.parameters}} for t in setup.tools]
        if not setup.active:
            return out, {"tools": None}
        # `functions`: the same list as JSON text, for templates written for llama.cpp's older tool formats
        return out, {"tools": tools, "functions": json.dumps(tools, indent=2, ensure_ascii=False)}

    def grammar(self, setup: ToolSetup) -> GrammarSpec | None:
        if not setup.active:
            return None
        triggers = (OPEN_TAG,) if setup.choice.mode == "auto" else ()
        return GrammarSpec(_tagged_gbnf(_setup_key(setup)), root=BLOCK_RULE, lazy_triggers=triggers)

    def output(self, setup: ToolSetup) -> Output:
        return TaggedOutput() if setup.active else PlainOutput()


def protocol_for(native: bool) -> GenericProtocol | TaggedProtocol:
    return TaggedProtocol() if native else GenericProtocol()


def generic_instructions(setup: ToolSetup) -> str:
    lines = ["You can use these tools. Each line gives a tool's name, what it does and a JSON Schema "
             "of its arguments:"]
    lines += [json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                         ensure_ascii=False) for t in setup.tools]
    if setup.parallel:
        call = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}, ...]}'
    else:
        call = '{"tool_call": {"name": "<tool name>", "arguments": {<arguments>}}}'
    lines += ["", "Reply with one JSON object and nothing else."]
    if setup.choice.mode == "auto":
        lines += [f"To use a tool: {call}", 'To answer the user directly: {"response": "<your answer>"}']
    elif setup.choice.mode == "required":
        lines += [f"You must use a tool: {call}"]
    else:
        lines += [f'You must use the tool "{setup.choice.name}": {call}']
    return "\n".join(lines)


def _call_names(messages: tuple[Message, ...]) -> dict[str, str]:
    """tool_call_id -> function name, from the assistant turns."""
    return {c.id: c.name for m in messages for c in m.tool_calls}


def _generic_message(m: Message, names: dict[str, str], active: bool) -> dict:
    role, content = m.role, m.content
    if role == "assistant" and m.tool_calls:
        calls = [{"name": c.name, "arguments": _loads_or_text(c.arguments)} for c in m.tool_calls]
        envelope = {"tool_call": calls[0]} if len(calls) == 1 else {"tool_calls": calls}
        return {"role": "assistant", "content": json.dumps(envelope, ensure_ascii=False)}
    if role == "assistant" and active:
        return {"role": "assistant", "content": json.dumps({"response": content}, ensure_ascii=False)}
    if role == "tool":
        result = {"name": m.name or names.get(m.tool_call_id or ""), "content": content}
        return {"role": "user", "content": json.dumps({"tool_result": result}, ensure_ascii=False)}
    return {"role": role, "content": content}


def _tagged_message(m: Message) -> dict:
    out = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _loads_or_text(c.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _with_system_text(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{text}" if first["content"] else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _loads_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
