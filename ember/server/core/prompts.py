"""Prompts -> token ids: a `Chat` through the tool-call protocol and the chat template, and
completion `Prompts` (text and ids) through the tokenizer.

These run off the event loop (they render and tokenize). A prompt that a cheap lower bound on
its token count (tokenfloor.py) already puts past the context is refused before tokenizing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

from ...tokenizer.chat import ChatTemplateError
from ..errors import context_exceeded, invalid
from ..state import ServerModel
from .request import Chat, Prompts
from .tools import protocol_for

MARK = "\u2063ember:continue\u2063"  # ends the final message while rendering; the prompt is cut there


@dataclass(slots=True)
class ChatPrompt:
    text: str  # as rendered
    prefill: str = ""  # the final assistant message the reply continues
    ids: list[int] = field(default_factory=list)


def template_globals() -> dict:
    """Variables templates read besides the messages (llama.cpp sets these): today's date, the
    time in UTC, and `functions` (the tools as JSON text; empty unless the template formats tools)."""
    now = datetime.now()
    return {"date_string": now.strftime("%d %b %Y"),
            "datetime": datetime.now(timezone.utc).strftime("%b %d %Y %H:%M:%S GMT"), "functions": ""}


def render_chat(model: ServerModel, chat: Chat) -> ChatPrompt:
    """The prompt text: messages (and tools) through the protocol and the chat template."""
    msgs, extra = protocol_for(model.native_tools).messages(chat.messages, chat.tools)
    prefill = msgs[-1]["content"] if chat.continue_final else ""
    if chat.continue_final:
        msgs = [*msgs[:-1], {**msgs[-1], "content": prefill + MARK}]
    try:
        text = model.chat_template.render(msgs, add_generation_prompt=chat.add_generation_prompt,
                                          **{**template_globals(), **chat.template_kwargs, **extra})
    except ChatTemplateError as e:
        raise invalid(chat.param, str(e), "template_error") from None
    if not chat.continue_final:
        return ChatPrompt(text)
    end = text.rfind(MARK)
    if end < 0:
        raise invalid(chat.param, "the chat template does not write the final assistant message as given, so it "
                                  "cannot be continued", "template_error")
    return ChatPrompt(text[:end], prefill)


def chat_prompt(model: ServerModel, chat: Chat) -> ChatPrompt:
    prompt = render_chat(model, chat)
    check_floor(model, [prompt.text], chat.param)
    prompt.ids = model.chat_template.encode(model.tokenizer, prompt.text)
    check_prompt_fits(prompt.ids, model, chat.param)
    return prompt


def prompt_ids(model: ServerModel, prompts: Prompts) -> list[list[int]]:
    """Each prompt's ids: its text tokenized (BOS only when it starts with text), its ids as given."""
    out = []
    for parts, param in zip(prompts.parts, prompts.params):
        check_floor(model, parts, param)
        ids: list[int] = []
        for j, part in enumerate(parts):
            ids += _tokenize(model, part, j == 0) if isinstance(part, str) else [part]
        out.append(ids)
    for ids, param in zip(out, prompts.params):
        check_prompt_fits(ids, model, param)
    return out


def check_floor(model: ServerModel, parts, param: str) -> None:
    """Refuse, without tokenizing, a prompt whose parts surely hold more tokens than the context."""
    if model.floor is None:
        return
    at_least = sum(model.floor.tokens(p) if isinstance(p, str) else 1 for p in parts)
    if at_least > model.n_ctx:
        raise context_exceeded(param, at_least, model.n_ctx, at_least=True)


def check_prompt_fits(ids: list[int], model: ServerModel, param: str) -> None:
    if not ids:
        raise invalid(param, "the prompt is empty", "empty_prompt")
    if len(ids) > model.n_ctx:
        raise context_exceeded(param, len(ids), model.n_ctx)


def _tokenize(model: ServerModel, text: str, add_special: bool) -> list[int]:
    return model.tokenizer.encode(text, add_special=add_special, parse_special=True)


def token_piece(model: ServerModel, token: int) -> bytes:
    return model.tokenizer.token_to_piece(token, special=True)
