"""Request prompts -> token ids: chat messages through the chat template (and the tool-call
protocol), and completion prompts given as text, ids, a mix of both, or a list of those."""
from __future__ import annotations

import json

from ..tokenizer.chat import ChatTemplateError
from .errors import APIError, invalid
from .fields import Fields
from .generation import check_prompt_fits
from .state import ServerModel
from .replies import ToolCall, new_call_id
from .tools import ToolSetup, protocol_for

ROLES = ("system", "developer", "user", "assistant", "tool")


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


def render_chat(model: ServerModel, messages: list[dict], setup: ToolSetup, add_generation_prompt: bool = True,
                template_kwargs: dict | None = None) -> str:
    """The prompt text: messages (and tools) through the protocol and the chat template."""
    msgs, extra = protocol_for(model.native_tools).messages(messages, setup)
    try:
        return model.chat_template.render(msgs, add_generation_prompt=add_generation_prompt,
                                          **(template_kwargs or {}), **extra)
    except ChatTemplateError as e:
        raise invalid("messages", str(e), "template_error") from None


def chat_prompt(model: ServerModel, messages: list[dict], setup: ToolSetup,
                template_kwargs: dict | None = None) -> list[int]:
    text = render_chat(model, messages, setup, True, template_kwargs)
    ids = model.chat_template.encode(model.tokenizer, text)
    check_prompt_fits(ids, model, "messages")
    return ids


def template_kwargs(body: Fields) -> dict:
    """llama-server's chat_template_kwargs: extra variables for the template."""
    extra = body.object("chat_template_kwargs")
    if extra is None:
        return {}
    reserved = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"} & extra.data.keys()
    if reserved:
        raise invalid("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
    return dict(extra.data)


# ---- completion prompts ----

def completion_prompts(body: Fields, model: ServerModel, key: str = "prompt") -> list[list[int]]:
    """`prompt` as text, ids, mixed text and ids, or an array of those (several prompts)."""
    raw = body.data.get(key)
    if raw is None:
        raise invalid(key, f"{key} is required", "missing_field")
    if isinstance(raw, str):
        prompts = [_tokenize(model, raw, True)]
    elif isinstance(raw, list) and raw and all(isinstance(p, (str, list)) for p in raw):
        prompts = [_one_prompt(model, p, f"{key}[{i}]") for i, p in enumerate(raw)]
    else:
        prompts = [_one_prompt(model, raw, key)]
    for i, ids in enumerate(prompts):
        check_prompt_fits(ids, model, key if len(prompts) == 1 else f"{key}[{i}]")
    return prompts


def _one_prompt(model: ServerModel, p, param: str) -> list[int]:
    if isinstance(p, str):
        return _tokenize(model, p, True)
    if not isinstance(p, list):
        raise invalid(param, f"{param} must be text, token ids or a mix of both", "invalid_type")
    ids: list[int] = []
    for j, part in enumerate(p):
        if isinstance(part, str):
            ids += _tokenize(model, part, j == 0)  # BOS only when the prompt starts with text
        elif _is_id(part):
            ids.append(check_token(model, int(part), f"{param}[{j}]"))
        else:
            raise invalid(f"{param}[{j}]", f"{param}[{j}] must be a token id or text", "invalid_type")
    return ids


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
