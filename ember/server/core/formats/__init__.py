"""Each model family's own chat format: how its template wants tool calls, tool results and
earlier reasoning in the conversation, how its replies write calls and reasoning (read whole and
while they stream), and the grammar that holds a reply to a call in the family's syntax.

One module per family, each a `ChatFormat` (base.py). `detect` picks the format from the chat
template's own text (the markers it renders), never from the file name; a template that renders
`tools` in a way no family here knows gets the Hermes syntax ("tagged"), and one that does not
render tools at all keeps the generic protocol (tools.py) with no family format.
"""
from __future__ import annotations

from .base import ChatFormat, FormatOutput, Reading, thinking_opened
from .deepseek import DeepSeekR1, DeepSeekV31
from .functionary import Functionary
from .glm import GLM
from .granite import Granite
from .harmony import Harmony
from .hermes import Hermes, Tagged
from .kimi import Kimi
from .llama3 import Llama3
from .mistral import Mistral, MistralNemo, MistralReasoning
from .qwen_xml import QwenXML

# most specific first: Qwen3-Coder's template also holds <tool_call>, R1's and V3.1's share markers
FAMILIES: tuple[ChatFormat, ...] = (Harmony(), QwenXML(), GLM(), Hermes(), MistralReasoning(), Mistral(),
                                    MistralNemo(), DeepSeekR1(), DeepSeekV31(), Kimi(), Functionary(), Granite(), Llama3())
THINK = ("<think>", "</think>")


class Plain(ChatFormat):
    """A template of no family: no calls of its own; <think>...</think> reasoning where the
    template speaks of it."""

    name = "generic"

    def __init__(self, think: tuple[str, str] | None = None):
        self.think = think

    def matches(self, template: str) -> bool:
        return False


def detect(template: str, renders_tools: bool) -> ChatFormat:
    """The family whose markers the template renders; else Hermes tags where the template renders
    `tools` itself, else the generic protocol (`Plain`)."""
    for fmt in FAMILIES:
        if fmt.matches(template):
            return fmt.configured(template)
    if renders_tools:
        return Tagged()
    return Plain(THINK if THINK[0] in template else None)


__all__ = ["FAMILIES", "ChatFormat", "FormatOutput", "Plain", "Reading", "detect", "thinking_opened"]
