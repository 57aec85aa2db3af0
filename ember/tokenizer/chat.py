"""Chat templates: messages -> prompt text, with the file's Jinja template or a built-in one.

    tmpl = ChatTemplate.from_metadata(md)
    text = tmpl.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    ids = tmpl.encode(tok, text)      # or: tok.encode(tmpl.strip_bos_eos(text), True, True)

Templates run in Jinja's immutable sandbox with what Hugging Face templates expect:
`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `tools`, the functions
`raise_exception` and `strftime_now`, a `tojson` filter that leaves non-ASCII text alone,
`trim_blocks`/`lstrip_blocks` and loop controls.

BOS: many templates write the BOS text themselves (Gemma's does). Like llama.cpp, we then
tokenize the rendered text with BOS/EOS added as the metadata says, after cutting a leading
BOS text (when the tokenizer adds BOS) and a trailing EOS text (when it adds EOS), so the
prompt holds exactly one BOS. Special-token text in the rendered prompt is parsed as tokens.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from importlib import resources
from typing import Any

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Jinja is imported on first use: it costs start-up time otherwise
    import jinja2

from .vocab import add_bos_eos

# general.architecture -> built-in template, for files without tokenizer.chat_template
BUILTIN_BY_ARCH = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma"}
FALLBACK = "chatml"


class ChatTemplateError(ValueError):
    """A template that does not compile or fails while rendering (raise_exception included)."""


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    template: jinja2.Template
    source: str            # "file", "builtin:gemma" or "builtin:chatml"
    bos_token: str = ""
    eos_token: str = ""
    add_bos: bool = False  # whether the tokenizer adds BOS (then a leading BOS text is cut)
    add_eos: bool = False

    @classmethod
    def from_metadata(cls, md: dict[str, Any]) -> ChatTemplate:
        """The file's template, else the built-in one for general.architecture, else ChatML."""
        tokens = {role: special_text(md, role) for role in ("bos", "eos")}
        flags = dict(zip(("add_bos", "add_eos"), add_bos_eos(md)))
        text = md.get("tokenizer.chat_template")
        if isinstance(text, str) and text.strip():
            return cls.from_string(text, "file", tokens["bos"], tokens["eos"], **flags)
        name = BUILTIN_BY_ARCH.get(md.get("general.architecture", ""), FALLBACK)
        return cls.from_string(builtin_source(name), f"builtin:{name}", tokens["bos"], tokens["eos"], **flags)

    @classmethod
    def from_string(cls, text: str, source: str = "file", bos_token: str = "", eos_token: str = "",
                    add_bos: bool = False, add_eos: bool = False) -> ChatTemplate:
        import jinja2

        try:
            template = environment().from_string(text)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template ({source}) does not compile: {describe(e)}") from e
        return cls(template, source, bos_token, eos_token, bool(add_bos), bool(add_eos))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, **extra: Any) -> str:
        """The template's output as is (including any BOS text it writes)."""
        context = {**extra, "messages": messages, "add_generation_prompt": add_generation_prompt,
                   "tools": tools, "bos_token": self.bos_token, "eos_token": self.eos_token}
        try:
            return self.template.render(**context)
        except ChatTemplateError:
            raise
        except Exception as e:  # templates fail in many ways: undefined calls, type errors, ...
            raise ChatTemplateError(f"chat template ({self.source}) failed: {describe(e)}") from e

    def strip_bos_eos(self, text: str) -> str:
        """Cut the BOS/EOS text that the tokenizer will add as tokens anyway (llama.cpp does the same)."""
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        if self.add_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[:-len(self.eos_token)]
        return text

    def encode(self, tokenizer, text: str) -> list[int]:
        """Rendered prompt -> ids with exactly one BOS, special-token text parsed."""
        return tokenizer.encode(self.strip_bos_eos(text), add_special=True, parse_special=True)


def special_text(md: dict[str, Any], role: str) -> str:
    tokens, i = md.get("tokenizer.ggml.tokens"), md.get(f"tokenizer.ggml.{role}_token_id")
    if i is None and md.get("tokenizer.ggml.model") == "llama":
        i = {"bos": 1, "eos": 2}[role]  # SentencePiece's defaults, as the tokenizer uses them
    if isinstance(tokens, list) and isinstance(i, int) and 0 <= i < len(tokens):
        return tokens[i]
    return ""


def builtin_source(name: str) -> str:
    return resources.files(__package__).joinpath("templates", f"{name}.jinja").read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = to_json
    env.filters["content_text"] = content_text
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def to_json(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    """JSON as Python writes it, non-ASCII kept (Jinja's own tojson escapes for HTML)."""
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


def content_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of an OpenAI-style part list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template raised: {message}")


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def describe(e: Exception) -> str:
    where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
    return f"{type(e).__name__}: {e}{where}"
