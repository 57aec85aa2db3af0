"""Responses bodies -> the core's `Generation`, through OpenAI's chat shape.

instructions -> a system message; `input` (a string, or items: messages with input_text /
output_text parts, function_call, function_call_output, reasoning) -> messages, after the
conversation of `previous_response_id`; flat function tools -> chat tools; text.format
(json_schema, json_object) -> response_format; max_output_tokens -> max_tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..core.request import Generation, Limits
from ..errors import APIError, invalid
from ..fields import Fields
from ..openai.request import parse_chat
from .store import ResponseStore

ROLES = ("user", "assistant", "system", "developer")


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    gen: Generation
    messages: list[dict]  # the conversation sent (without the instructions), for the store
    stream: bool = False
    store: bool = True
    model: str | None = None
    previous: str | None = None
    echo: dict = field(default_factory=dict)  # request fields the response repeats


def parse_responses(body: Fields, limits: Limits, store: ResponseStore) -> ResponsesRequest:
    previous = body.str("previous_response_id")
    history = []
    if previous is not None:
        kept = store.get(previous)
        if kept is None:
            raise not_kept(previous, "previous_response_id")
        history = kept[0]
    messages = [*history, *input_messages(body)]
    instructions = body.str("instructions")
    chat = {"messages": ([{"role": "system", "content": instructions}] if instructions else []) + messages}
    if body.has("max_output_tokens"):
        chat["max_tokens"] = body.int("max_output_tokens", lo=1)
    for key in ("temperature", "top_p", "top_k", "parallel_tool_calls", "seed"):
        if body.has(key):
            chat[key] = body.raw(key)
    if body.list("tools"):
        chat["tools"] = [tool(Fields(t, f"tools[{i}]")) for i, t in enumerate(body.list("tools"))]
    if body.has("tool_choice"):
        chat["tool_choice"] = tool_choice(body)
    fmt = text_format(body)
    if fmt is not None:
        chat["response_format"] = fmt
    gen = parse_chat(Fields(chat), limits).gen
    echo = {k: body.raw(k) for k in ("instructions", "temperature", "top_p", "max_output_tokens", "metadata")}
    return ResponsesRequest(gen, messages, body.bool("stream", False), body.bool("store", True), body.str("model"),
                            previous, echo)


def not_kept(response_id: str, param: str | None) -> APIError:
    return APIError(404, f"no response {response_id!r} is kept here (responses are kept in memory, the latest "
                         "ones only)", param=param, code="not_found")


def input_messages(body: Fields) -> list[dict]:
    value = body.raw("input")
    if value is None:
        raise invalid("input", "input is required: a string or an array of input items", "missing_field")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input", "input must be a string or a non-empty array of input items", "invalid_type")
    out: list[dict] = []
    for i, raw in enumerate(value):
        add_item(out, Fields(raw, f"input[{i}]"))
    return out


def add_item(out: list[dict], item: Fields) -> None:
    kind = item.str("type", "message")
    if kind == "message":
        role = item.choice("role", ROLES)
        if role is None:
            raise invalid(item.name("role"), f"{item.name('role')} is required", "missing_field")
        out.append({"role": role, "content": content_text(item)})
    elif kind == "function_call":
        call = {"id": item.str("call_id"), "type": "function",
                "function": {"name": item.str("name"), "arguments": item.str("arguments", "{}")}}
        last = out[-1] if out and out[-1]["role"] == "assistant" else None
        if last is None:
            last = {"role": "assistant", "content": ""}
            out.append(last)
        last.setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        output = item.raw("output", "")
        out.append({"role": "tool", "tool_call_id": item.str("call_id"),
                    "content": output if isinstance(output, str) else content_text(item, "output")})
    elif kind == "reasoning":
        text = "".join(Fields(p, item.name("content")).str("text", "") for p in item.list("content", []))
        out.append({"role": "assistant", "content": "", "reasoning_content": text})
    else:
        raise invalid(item.name("type"), f"{item.name('type')}: input items of type {kind!r} are not supported "
                                         "(message, function_call, function_call_output, reasoning)", "unsupported")


def content_text(item: Fields, key: str = "content") -> str:
    value = item.raw(key, "")
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(item.name(key), f"{item.name(key)} must be a string or an array of parts", "invalid_type")
    texts = []
    for j, raw in enumerate(value):
        p = Fields(raw, f"{item.name(key)}[{j}]")
        kind = p.str("type")
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise invalid(p.name("type"), f"{p.name('type')}: parts of type {kind!r} are not supported here (text "
                                          "models: input_text, output_text)", "unsupported")
        texts.append(p.str("refusal" if kind == "refusal" else "text", ""))
    return "".join(texts)


def tool(t: Fields) -> dict:
    if t.str("type", "function") != "function":
        raise invalid(t.name("type"), f"{t.name('type')}: only function tools run here", "unsupported")
    if t.str("name") is None:
        raise invalid(t.name("name"), f"{t.name('name')} is required", "missing_field")
    function = {"name": t.str("name"), "parameters": t.raw("parameters", {"type": "object", "properties": {}})}
    if t.has("description"):
        function["description"] = t.str("description")
    return {"type": "function", "function": function}


def tool_choice(body: Fields):
    value = body.raw("tool_choice")
    if isinstance(value, str):
        return value
    c = body.object("tool_choice")
    return {"type": "function", "function": {"name": c.str("name")}}


def text_format(body: Fields) -> dict | None:
    text = body.object("text")
    fmt = text.object("format") if text is not None else None
    if fmt is None:
        return None
    kind = fmt.choice("type", ("text", "json_object", "json_schema"), "text")
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.str("name", "output"), "schema": fmt.raw("schema"),
                                                       "strict": fmt.bool("strict", False)}}
    return {"type": kind}
