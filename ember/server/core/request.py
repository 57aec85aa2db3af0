"""The typed request the core runs, whichever API it came in by.

An API's parser reads its body into a `Generation` (a `Chat` or `Prompts` to generate from, and
how), checking every field and naming it in its errors; `Limits` is what it reads the body
against. The dataclasses check on construction the invariants the core relies on: a ValueError
from them is a parser's bug, not a client's mistake (which the parser reports first, as a 400
naming the field).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ...engine.engine import GrammarSpec
from ...engine.speculate import DraftParams
from ...gbnf.schema import SchemaError, json_object_gbnf, schema_to_gbnf
from ...sampler import SamplingParams
from ..errors import invalid
from ..state import ServerConfig, ServerModel
from .replies import ToolCall

ROLES = ("system", "user", "assistant", "tool")
TOOL_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}")
TOOL_CHOICES = ("auto", "none", "required", "function")
REASONING_FORMATS = ("none", "auto", "deepseek")  # llama-server's (auto: as deepseek)
SPELLINGS = {"temperature": {"temperature", "temp"}, "typical_p": {"typical_p", "typ_p"}}  # llama-server's aliases


# ---- what a body is read against ----

@dataclass(frozen=True, slots=True)
class Limits:
    """The server's caps and defaults and the model's vocabulary and context."""

    n_vocab: int
    n_ctx: int
    max_sequences: int = 16  # prompts x n one request may ask for
    max_stop: int = 16  # stop strings
    n_predict: int = -1  # the default token limit; -1: until the context is full
    sampling: tuple[tuple[str, Any], ...] = ()  # server-wide sampling defaults
    draft: DraftParams = DraftParams()  # the engine's drafting limits, which a request's `speculative` fields change

    @classmethod
    def of(cls, config: ServerConfig, model: ServerModel) -> Limits:
        draft = model.engine.config.speculative.draft if model.engine is not None else DraftParams()  # embeddings mode
        return cls(model.model.n_vocab, model.n_ctx, config.max_sequences, config.max_stop, config.n_predict,
                   config.sampling, draft)

    def max_tokens(self, given: int | None) -> int:
        """A request's token limit: its own, else the server's default (-1: until the context is full)."""
        limit = self.n_predict if given is None or given == -1 else given
        return self.n_ctx if limit == -1 else limit

    def check_sequences(self, n_prompts: int, n: int, param: str = "prompt") -> None:
        """One request may not fill the queue: prompts x n is capped."""
        if n_prompts * n > self.max_sequences:
            raise invalid(param, f"{n_prompts} prompt(s) with n={n} ask for {n_prompts * n} sequences; a request may "
                                 f"ask for at most {self.max_sequences} (prompts x n)", "too_many_sequences")

    def check_token(self, token: int, param: str) -> int:
        if not 0 <= token < self.n_vocab:
            raise invalid(param, f"{param}: token id {token} is outside the vocabulary (0..{self.n_vocab - 1})",
                          "invalid_token")
        return token

    def sampling_params(self, given: dict[str, Any]) -> SamplingParams:
        """SamplingParams from a body's sampling fields (SamplingParams' names, or llama-server's
        aliases) over the server's defaults; 400 naming the field that is wrong."""
        given = dict(given)
        for key, value in self.sampling:
            if not given.keys() & SPELLINGS.get(key, {key}):
                given[key] = value
        try:
            params = SamplingParams.from_dict(given)
        except (ValueError, TypeError) as e:
            raise invalid(_failing_key(given), str(e)) from None
        for token, _ in params.logit_bias:
            if isinstance(token, int) and token >= self.n_vocab:
                raise invalid("logit_bias", f"logit_bias: token id {token} is outside the vocabulary "
                                            f"(0..{self.n_vocab - 1})")
        return params


def _failing_key(given: dict) -> str | None:
    for key, value in given.items():
        try:
            SamplingParams.from_dict({key: value})
        except (ValueError, TypeError):
            return key
    return None


# ---- tools ----

@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON Schema of the arguments object

    def __post_init__(self):
        if not TOOL_NAME.fullmatch(self.name) or not isinstance(self.parameters, dict):
            raise ValueError(f"a tool needs a name of 1-64 letters, digits, '_' or '-' and a schema object "
                             f"({self.name!r})")


def check_tool_parameters(parameters: dict, param: str) -> None:
    """400 naming `param` for a tool's arguments schema that no grammar can enforce."""
    try:
        _check_schema(json.dumps(parameters))
    except SchemaError as e:
        raise invalid(param, f"{param}: {e}", "invalid_json_schema") from None


@lru_cache(maxsize=256)
def _check_schema(schema_json: str) -> None:
    schema_to_gbnf(json.loads(schema_json))


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: str = "auto"  # "auto", "none", "required" or "function"
    name: str | None = None  # the function, for mode "function"

    def __post_init__(self):
        if self.mode not in TOOL_CHOICES or (self.mode == "function") != (self.name is not None):
            raise ValueError(f"tool choice {self.mode!r} with name {self.name!r}")


@dataclass(frozen=True, slots=True)
class ToolSetup:
    tools: tuple[Tool, ...] = ()
    choice: ToolChoice = ToolChoice("none")
    parallel: bool = False

    def __post_init__(self):
        names = [t.name for t in self.tools]
        if len(set(names)) < len(names):
            raise ValueError("two tools share a name")
        if (not names and self.choice.mode != "none") or (self.choice.name is not None
                                                          and self.choice.name not in names):
            raise ValueError(f"tool choice {self.choice} among {names}")

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice.mode != "none"


# ---- prompts ----

@dataclass(frozen=True, slots=True)
class Message:
    role: str  # system, user, assistant or tool
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's
    tool_call_id: str | None = None  # a tool result's
    name: str | None = None
    reasoning: str = ""  # an assistant's earlier reasoning (reasoning_content)

    def __post_init__(self):
        if self.role not in ROLES or (self.tool_calls and self.role != "assistant"):
            raise ValueError(f"a {self.role!r} message (with {len(self.tool_calls)} tool calls)")


@dataclass(frozen=True, slots=True)
class Chat:
    """A conversation for the chat template: closed with the assistant's header
    (add_generation_prompt), or left open inside a final assistant message that the reply
    continues (continue_final; then no tools may be offered)."""

    messages: tuple[Message, ...]
    tools: ToolSetup = ToolSetup()
    add_generation_prompt: bool = True
    continue_final: bool = False
    template_kwargs: dict = field(default_factory=dict)  # extra template variables
    param: str = "messages"  # the field errors about the conversation name
    reasoning_format: str = "auto"  # "none": reasoning stays in the content; else it goes to reasoning_content
    reasoning_budget: int = -1  # reasoning tokens before the end-of-thinking marker is forced; -1: no limit

    def __post_init__(self):
        if not self.messages:
            raise ValueError("a chat needs a message")
        if self.reasoning_format not in REASONING_FORMATS or self.reasoning_budget < -1:
            raise ValueError(f"reasoning_format {self.reasoning_format!r}, reasoning_budget {self.reasoning_budget}")
        final = self.messages[-1]
        if self.continue_final and (self.add_generation_prompt or final.role != "assistant" or final.tool_calls
                                    or self.tools.active):
            raise ValueError("only a final assistant message without tool calls, a generation prompt or active "
                             "tools can be continued")


@dataclass(frozen=True, slots=True)
class Prompts:
    """Completion prompts, each its text and token ids in order (ids within the vocabulary)."""

    parts: tuple[tuple[str | int, ...], ...]
    params: tuple[str, ...]  # the field each prompt came from, for errors

    def __post_init__(self):
        if not self.parts or len(self.parts) != len(self.params):
            raise ValueError(f"{len(self.parts)} prompts named by {len(self.params)} fields")
        if not all(isinstance(p, str) or is_id(p) for parts in self.parts for p in parts):
            raise ValueError("prompt parts are text or token ids")

    @property
    def tools(self) -> ToolSetup:
        return ToolSetup()


def is_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---- output constraints ----

@dataclass(frozen=True, slots=True)
class Constraint:
    """A grammar the output must follow, and the field it came from (errors about it name it)."""

    grammar: GrammarSpec
    param: str

    @classmethod
    def from_schema(cls, schema, param: str, at: str | None = None) -> Constraint:
        """A JSON Schema's grammar; 400 naming `at` (the schema's own field, default `param`) for
        a schema that has none."""
        at = at or param
        if not isinstance(schema, (dict, bool)):
            raise invalid(at, f"{at} must be a JSON Schema object", "invalid_type")
        try:
            return cls(GrammarSpec(_schema_gbnf(json.dumps(schema))), param)
        except SchemaError as e:
            raise invalid(at, f"{at}: {e}", "invalid_json_schema") from None
        except RecursionError:
            raise invalid(at, f"{at}: the schema nests too deeply", "invalid_json_schema") from None

    @classmethod
    def json_object(cls, param: str) -> Constraint:
        return cls(GrammarSpec(_json_object()), param)

    @classmethod
    def gbnf(cls, text: str, param: str) -> Constraint:
        """A grammar as GBNF text (checked when the engine compiles it)."""
        return cls(GrammarSpec(text), param)


@lru_cache(maxsize=128)
def _schema_gbnf(schema_json: str) -> str:
    return schema_to_gbnf(json.loads(schema_json))


@lru_cache(maxsize=1)
def _json_object() -> str:
    return json_object_gbnf()


# ---- the request ----

@dataclass(frozen=True, slots=True)
class Generation:
    """What the core runs: a prompt source, and how to generate from it."""

    prompt: Chat | Prompts
    max_tokens: int
    n: int = 1  # samples per prompt
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: int | None = None  # None: none; k: the chosen token's plus the top k
    constraint: Constraint | None = None  # besides the tools' own grammar, never with it
    progress: bool = False  # the engine reports how far the prompt is computed (ProgressEvents)
    speculative: DraftParams | None = None  # the request's drafting limits (None: the server's)

    def __post_init__(self):
        if self.max_tokens < 0 or self.n < 1 or (self.logprobs or 0) < 0 or "" in self.stop:
            raise ValueError(f"max_tokens {self.max_tokens}, n {self.n}, logprobs {self.logprobs}, stop {self.stop}")
        if self.constraint is not None and self.prompt.tools.active:
            raise ValueError("an output constraint cannot be combined with active tools")
