"""A chat in OpenAI's shape -> `Chat`: messages (text content, an assistant's tool calls, tool
results), tools with tool_choice and parallel_tool_calls, and llama-server's template options
(add_generation_prompt, continue_final_message, chat_template_kwargs), read in that order.
llama-server's /apply-template reads the same fields.
"""
from __future__ import annotations

import json

from ..core.replies import ToolCall, new_call_id
from ..core.request import TOOL_NAME, Chat, Message, Tool, ToolChoice, ToolSetup, check_tool_parameters
from ..errors import invalid
from ..fields import Fields

ROLES = ("system", "developer", "user", "assistant", "tool")
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def chat(body: Fields) -> Chat:
    messages = parse_messages(body)
    tools = parse_tools(body)
    add_prompt, continue_final = template_options(body, messages, tools)
    return Chat(messages, tools, add_prompt, continue_final, template_kwargs(body))


# ---- messages ----

def parse_messages(body: Fields, key: str = "messages") -> tuple[Message, ...]:
    raw = body.list(key)
    if not raw:
        raise invalid(key, f"{key} must be a non-empty array of messages", "missing_field")
    return tuple(_message(Fields(m, f"{key}[{i}]")) for i, m in enumerate(raw))


def _message(m: Fields) -> Message:
    role = m.choice("role", ROLES)
    if role is None:
        raise invalid(m.name("role"), f"{m.name('role')} is required", "missing_field")
    calls = _tool_calls(m) if role == "assistant" else ()
    return Message("system" if role == "developer" else role, _content(m), calls, m.str("tool_call_id"),
                   m.str("name"))


def _content(m: Fields) -> str:
    """Text content: a string, or the text parts of a part list."""
    content = m.raw("content", "")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(m.name("content"), f"{m.name('content')} must be a string or an array of parts", "invalid_type")
    texts = []
    for j, part in enumerate(content):
        p = Fields(part, f"{m.name('content')}[{j}]")
        kind = p.str("type")
        if kind != "text":
            raise invalid(p.name("type"), f"content parts of type {kind!r} are not supported (text only)",
                          "unsupported_content")
        texts.append(p.str("text", ""))
    return "".join(texts)


def _tool_calls(m: Fields) -> tuple[ToolCall, ...]:
    calls = []
    for j, raw in enumerate(m.list("tool_calls", [])):
        c = Fields(raw, f"{m.name('tool_calls')}[{j}]")
        fn = c.object("function")
        name = fn.str("name") if fn else None
        if not name:
            raise invalid(c.name("function.name"), f"{c.name('function.name')} is required", "missing_field")
        args = fn.raw("arguments", "{}")
        calls.append(ToolCall(c.str("id") or new_call_id(), name,
                              args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return tuple(calls)


# ---- tools ----

def parse_tools(body: Fields) -> ToolSetup:
    """tools, tool_choice and parallel_tool_calls; 400 naming the field for anything invalid."""
    tools = tuple(_parse_tool(body, i) for i in range(len(body.list("tools", []))))
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise invalid("tools", f"two tools are named {dup!r}")
    choice = _parse_choice(body, names)
    parallel = body.bool("parallel_tool_calls", False)
    return ToolSetup(tools, choice, parallel)


def _parse_tool(body: Fields, i: int) -> Tool:
    entry = Fields(body.data["tools"][i], f"tools[{i}]")
    if entry.choice("type", ("function",), "function") != "function":
        raise invalid(entry.name("type"), "only function tools are supported")
    fn = entry.object("function")
    if fn is None:
        raise invalid(entry.name("function"), f"{entry.name('function')} is required", "missing_field")
    name = fn.str("name")
    if name is None or not TOOL_NAME.fullmatch(name):
        raise invalid(fn.name("name"), f"{fn.name('name')} must be 1-64 letters, digits, '_' or '-', got {name!r}")
    params = fn.raw("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise invalid(fn.name("parameters"), "parameters must be a JSON Schema object", "invalid_type")
    check_tool_parameters(params, fn.name("parameters"))
    return Tool(name, fn.str("description", ""), params)


def _parse_choice(body: Fields, names: list[str]) -> ToolChoice:
    raw = body.raw("tool_choice")
    if raw is None:
        return ToolChoice("auto" if names else "none")
    if not names:
        raise invalid("tool_choice", "tool_choice needs tools")
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise invalid("tool_choice", f"tool_choice must be auto, none, required or a function, got {raw!r}")
        return ToolChoice(raw)
    fn = Fields(raw, "tool_choice").object("function")
    name = fn.str("name") if fn is not None else None
    if name is None:
        raise invalid("tool_choice", 'a named tool_choice is {"type": "function", "function": {"name": ...}}')
    if name not in names:
        raise invalid("tool_choice.function.name", f"tool_choice names {name!r}, which is not among the tools")
    return ToolChoice("function", name)


# ---- template options ----

def template_options(body: Fields, messages: tuple[Message, ...], tools: ToolSetup) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final) by llama-server's rules: a final assistant message
    is continued (unless it holds tool calls: llama-server refuses those, here the conversation
    goes on after them); continuing refuses a generation prompt, tool calls in that message and
    (here) active tools."""
    add_prompt = body.bool("add_generation_prompt", None)
    continue_final = body.bool("continue_final_message", None)
    if not continue_final and messages[-1].role == "assistant" and not messages[-1].tool_calls:
        if len(messages) > 1 and messages[-2].role == "assistant":
            raise invalid("messages", "messages end with two assistant messages; only the final one can be "
                                      "continued", "invalid_messages")
        continue_final, add_prompt = True, False
    if not continue_final:
        return add_prompt is not False, False
    if add_prompt is not False:
        raise invalid("continue_final_message", "continue_final_message and add_generation_prompt cannot both be "
                                                "true", "conflicting_fields")
    final = messages[-1]
    if final.role != "assistant":
        raise invalid("continue_final_message", "continue_final_message needs a final assistant message")
    if final.tool_calls:
        raise invalid("messages", "a final assistant message with tool calls cannot be continued")
    if tools.active:
        raise invalid("tools", "a final assistant message cannot be continued while tools are offered",
                      "conflicting_fields")
    return False, True


def template_kwargs(body: Fields) -> dict:
    """llama-server's chat_template_kwargs: extra variables for the template."""
    extra = body.object("chat_template_kwargs")
    if extra is None:
        return {}
    reserved = RESERVED & extra.data.keys()
    if reserved:
        raise invalid("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
    return dict(extra.data)
