"""Request prompts -> token ids: chat messages through the chat template (and the tool-call
protocol), and completion prompts given as text, ids, a mix of both, or a list of those.

These run off the event loop (they render and tokenize). A prompt that a cheap lower bound on
its token count (tokenfloor.py) already puts past the context is refused before tokenizing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone

from ..tokenizer.chat import ChatTemplateError
from .errors import APIError, context_exceeded, invalid
from .fields import Fields
from .generation import check_prompt_fits
from .replies import ToolCall, new_call_id
from .state import ServerModel
from .tools import ToolSetup, protocol_for

ROLES = ("system", "developer", "user", "assistant", "tool")
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
MARK = "\u2063ember:continue\u2063"  # ends the final message while rendering; the prompt is cut there


# ---- chat ----

def parse_messages(body: Fields, key: str = "messages") -> list[dict]:
    raw = body.list(key)
    if not raw:
        raise invalid(key, f"{key} must be a non-empty array of messages", "missing_field")
    return [_message(Fields(m, f"{key}[{i}]")) for i, m in enumerate(raw)]


def _message(m: Fields) -> dict:
    role = m.choice("role", ROLES)
    if role is None:
        raise invalid(m.name("role"), f"{m.name('role')} is required", "missing_field")
    calls = _tool_calls(m) if role == "assistant" else []
    return {"role": "system" if role == "developer" else role, "content": _content(m), "tool_calls": calls,
            "tool_call_id": m.str("tool_call_id"), "name": m.str("name")}


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


def _tool_calls(m: Fields) -> list[ToolCall]:
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
    return calls


@dataclass(slots=True)
class TemplateOptions:
    """How the conversation is closed: with the assistant's header (add_generation_prompt), or
    open inside a final assistant message that the reply continues (prefill)."""

    add_generation_prompt: bool = True
    continue_final: bool = False
    kwargs: dict = field(default_factory=dict)  # chat_template_kwargs


def template_options(body: Fields, messages: list[dict], setup: ToolSetup) -> TemplateOptions:
    """llama-server's rules: a final assistant message is continued (unless it holds tool calls:
    llama-server refuses those, here the conversation goes on after them); continuing refuses a
    generation prompt, tool calls in that message and (here) active tools."""
    add_prompt = body.bool("add_generation_prompt", None)
    continue_final = body.bool("continue_final_message", None)
    if not continue_final and messages[-1]["role"] == "assistant" and not messages[-1]["tool_calls"]:
        if len(messages) > 1 and messages[-2]["role"] == "assistant":
            raise invalid("messages", "messages end with two assistant messages; only the final one can be "
                                      "continued", "invalid_messages")
        continue_final, add_prompt = True, False
    if not continue_final:
        return TemplateOptions(add_prompt is not False, False, template_kwargs(body))
    if add_prompt is not False:
        raise invalid("continue_final_message", "continue_final_message and add_generation_prompt cannot both be "
                                                "true", "conflicting_fields")
    final = messages[-1]
    if final["role"] != "assistant":
        raise invalid("continue_final_message", "continue_final_message needs a final assistant message")
    if final["tool_calls"]:
        raise invalid("messages", "a final assistant message with tool calls cannot be continued")
    if setup.active:
        raise invalid("tools", "a final assistant message cannot be continued while tools are offered",
                      "conflicting_fields")
    return TemplateOptions(False, True, template_kwargs(body))


def template_kwargs(body: Fields) -> dict:
    """llama-server's chat_template_kwargs: extra variables for the template."""
    extra = body.object("chat_template_kwargs")
    if extra is None:
        return {}
    reserved = RESERVED & extra.data.keys()
    if reserved:
        raise invalid("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
    return dict(extra.data)


def template_globals() -> dict:
    """Variables templates read besides the messages (llama.cpp sets these): today's date, the
    time in UTC, and `functions` (the tools as JSON text; empty unless the template formats tools)."""
    now = datetime.now()
    return {"date_string": now.strftime("%d %b %Y"),
            "datetime": datetime.now(timezone.utc).strftime("%b %d %Y %H:%M:%S GMT"), "functions": ""}


@dataclass(slots=True)
class ChatPrompt:
    text: str  # as rendered
    prefill: str = ""  # the final assistant message the reply continues
    ids: list[int] = field(default_factory=list)


def render_chat(model: ServerModel, messages: list[dict], setup: ToolSetup,
                options: TemplateOptions = TemplateOptions()) -> ChatPrompt:
    """The prompt text: messages (and tools) through the protocol and the chat template."""
    msgs, extra = protocol_for(model.native_tools).messages(messages, setup)
    prefill = msgs[-1]["content"] if options.continue_final else ""
    if options.continue_final:
        msgs = [*msgs[:-1], {**msgs[-1], "content": prefill + MARK}]
    try:
        text = model.chat_template.render(msgs, add_generation_prompt=options.add_generation_prompt,
                                          **{**template_globals(), **options.kwargs, **extra})
    except ChatTemplateError as e:
        raise invalid("messages", str(e), "template_error") from None
    if not options.continue_final:
        return ChatPrompt(text)
    end = text.rfind(MARK)
    if end < 0:
        raise invalid("messages", "the chat template does not write the final assistant message as given, so it "
                                  "cannot be continued", "template_error")
    return ChatPrompt(text[:end], prefill)


def chat_prompt(model: ServerModel, messages: list[dict], setup: ToolSetup,
                options: TemplateOptions = TemplateOptions()) -> ChatPrompt:
    prompt = render_chat(model, messages, setup, options)
    check_floor(model, [prompt.text], "messages")
    prompt.ids = model.chat_template.encode(model.tokenizer, prompt.text)
    check_prompt_fits(prompt.ids, model, "messages")
    return prompt


# ---- completion prompts ----

def prompt_items(body: Fields, key: str = "prompt") -> list:
    """`prompt` as the list of its prompts (each text, ids, mixed text and ids, or
    {"prompt_string": text}); counted before any is tokenized."""
    raw = body.data.get(key)
    if raw is None:
        raise invalid(key, f"{key} is required", "missing_field")
    if isinstance(raw, list) and raw and all(isinstance(p, (str, list, dict)) for p in raw):
        return raw
    return [raw]


def completion_prompts(items: list, model: ServerModel, key: str = "prompt") -> list[list[int]]:
    params = [key] if len(items) == 1 else [f"{key}[{i}]" for i in range(len(items))]
    prompts = [_one_prompt(model, p, param) for p, param in zip(items, params)]
    for ids, param in zip(prompts, params):
        check_prompt_fits(ids, model, param)
    return prompts


def _one_prompt(model: ServerModel, p, param: str) -> list[int]:
    if isinstance(p, dict):
        p = _prompt_object(Fields(p, param))
    parts = [p] if isinstance(p, str) else p
    if not isinstance(parts, list):
        raise invalid(param, f"{param} must be text, token ids or a mix of both", "invalid_type")
    for j, part in enumerate(parts):
        if not isinstance(part, str) and not _is_id(part):
            where = f"{param}[{j}]" if parts is p else param
            raise invalid(where, f"{where} must be a token id or text", "invalid_type")
    check_floor(model, parts, param)
    ids: list[int] = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            ids += _tokenize(model, part, j == 0)  # BOS only when the prompt starts with text
        else:
            ids.append(check_token(model, int(part), f"{param}[{j}]"))
    return ids


def _prompt_object(p: Fields) -> str:
    """llama-server's {"prompt_string": text, "multimodal_data": [...]} (text only here)."""
    if p.list("multimodal_data"):
        raise invalid(p.name("multimodal_data"), "multimodal_data is not supported (text models only)", "unsupported")
    text = p.str("prompt_string")
    if text is None:
        raise invalid(p.name("prompt_string"), f"{p.name('prompt_string')} is required", "missing_field")
    return text


def check_floor(model: ServerModel, parts: list, param: str) -> None:
    """Refuse, without tokenizing, a prompt whose parts surely hold more tokens than the context."""
    if model.floor is None:
        return
    at_least = sum(model.floor.tokens(p) if isinstance(p, str) else 1 for p in parts)
    if at_least > model.n_ctx:
        raise context_exceeded(param, at_least, model.n_ctx, at_least=True)


def _is_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tokenize(model: ServerModel, text: str, add_special: bool) -> list[int]:
    return model.tokenizer.encode(text, add_special=add_special, parse_special=True)


def check_token(model: ServerModel, token: int, param: str) -> int:
    n_vocab = model.model.n_vocab
    if not 0 <= token < n_vocab:
        raise APIError(400, f"{param}: token id {token} is outside the vocabulary (0..{n_vocab - 1})",
                       param=param, code="invalid_token")
    return token
