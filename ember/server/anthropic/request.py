"""Anthropic Messages bodies -> the core's `Generation`, through OpenAI's chat shape.

system -> a system message; user content blocks: text joined, each tool_result its own tool
message (before the text, as they answer the calls of the turn before); assistant blocks: text,
tool_use -> tool calls, thinking -> reasoning; tools' input_schema -> parameters; tool_choice
auto/any/tool/none -> auto/required/the function/none; thinking enabled -> a reasoning budget of
budget_tokens, disabled -> none.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..core.request import Generation, Limits
from ..errors import invalid
from ..fields import Fields
from ..openai.request import parse_chat


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    gen: Generation
    stream: bool = False
    model: str | None = None


def parse_messages(body: Fields, limits: Limits) -> MessagesRequest:
    max_tokens = body.int("max_tokens", None, lo=1)
    if max_tokens is None:
        raise invalid("max_tokens", "max_tokens is required", "missing_field")
    chat = openai_chat(body)
    chat["max_tokens"] = max_tokens
    return MessagesRequest(parse_chat(Fields(chat), limits).gen, body.bool("stream", False), body.str("model"))


def openai_chat(body: Fields) -> dict:
    """The body in OpenAI's chat shape (what count_tokens renders as well)."""
    out: dict = {"messages": system(body) + [m for i, raw in enumerate(body.list("messages") or [])
                                             for m in message(Fields(raw, f"messages[{i}]"))]}
    if not body.list("messages"):
        raise invalid("messages", "messages must be a non-empty array of messages", "missing_field")
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k")):
        if body.has(src):
            out[dst] = body.raw(src)
    if body.has("stop_sequences"):
        out["stop"] = list(body.strings("stop_sequences"))
    if body.list("tools"):
        out["tools"] = [tool(Fields(t, f"tools[{i}]")) for i, t in enumerate(body.list("tools"))]
    choice = body.object("tool_choice")
    if choice is not None:
        out["tool_choice"] = tool_choice(choice)
        if choice.bool("disable_parallel_tool_use", False):
            out["parallel_tool_calls"] = False
    out.update(thinking(body.object("thinking")))
    return out


def system(body: Fields) -> list[dict]:
    value = body.raw("system")
    if value is None:
        return []
    return [{"role": "system", "content": text_of(value, "system")}]


def text_of(value, name: str) -> str:
    """A string, or the text of a list of text blocks."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(name, f"{name} must be a string or an array of text blocks", "invalid_type")
    texts = []
    for i, block in enumerate(value):
        b = Fields(block, f"{name}[{i}]")
        if b.str("type") != "text":
            raise invalid(b.name("type"), f"{b.name('type')} must be text here", "unsupported")
        texts.append(b.str("text", ""))
    return "".join(texts)


def message(m: Fields) -> list[dict]:
    role = m.choice("role", ("user", "assistant"))
    if role is None:
        raise invalid(m.name("role"), f"{m.name('role')} is required (user or assistant)", "missing_field")
    content = m.raw("content", "")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(m.name("content"), f"{m.name('content')} must be a string or an array of blocks", "invalid_type")
    blocks = [Fields(b, f"{m.name('content')}[{i}]") for i, b in enumerate(content)]
    return user_blocks(blocks) if role == "user" else [assistant_blocks(blocks)]


def user_blocks(blocks: list[Fields]) -> list[dict]:
    results, texts = [], []
    for b in blocks:
        kind = b.str("type")
        if kind == "text":
            texts.append(b.str("text", ""))
        elif kind == "tool_result":
            content = text_of(b.raw("content", ""), b.name("content"))
            if b.bool("is_error", False):
                content = "Error: " + content
            results.append({"role": "tool", "tool_call_id": b.str("tool_use_id"), "content": content})
        else:
            raise unsupported_block(b, kind)
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def assistant_blocks(blocks: list[Fields]) -> dict:
    out: dict = {"role": "assistant", "content": ""}
    for b in blocks:
        kind = b.str("type")
        if kind == "text":
            out["content"] += b.str("text", "")
        elif kind == "thinking":
            out["reasoning_content"] = out.get("reasoning_content", "") + b.str("thinking", "")
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            arguments = json.dumps(b.raw("input", {}), ensure_ascii=False)
            out.setdefault("tool_calls", []).append(
                {"id": b.str("id"), "type": "function", "function": {"name": b.str("name"), "arguments": arguments}})
        else:
            raise unsupported_block(b, kind)
    return out


def unsupported_block(b: Fields, kind) -> Exception:
    return invalid(b.name("type"), f"{b.name('type')}: content blocks of type {kind!r} are not supported here "
                                   "(text models: text, tool_use, tool_result, thinking)", "unsupported")


def tool(t: Fields) -> dict:
    if t.str("name") is None:
        raise invalid(t.name("name"), f"{t.name('name')} is required", "missing_field")
    function = {"name": t.str("name"), "parameters": t.raw("input_schema", {"type": "object"})}
    if t.has("description"):
        function["description"] = t.str("description")
    return {"type": "function", "function": function}


def tool_choice(c: Fields):
    kind = c.choice("type", ("auto", "any", "tool", "none"), "auto")
    if kind == "tool":
        return {"type": "function", "function": {"name": c.str("name")}}
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


def thinking(t: Fields | None) -> dict:
    if t is None:
        return {}
    kind = t.choice("type", ("enabled", "disabled", "adaptive"), "enabled")
    if kind == "disabled":
        return {"reasoning_budget": 0}
    budget = t.int("budget_tokens", None, lo=0)
    return {"reasoning_budget": budget} if budget is not None else {}
