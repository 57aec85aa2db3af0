"""Runs written back as Anthropic messages: content blocks (thinking, text, tool_use), stop_reason,
usage; streamed as message_start, content_block_start/delta/stop per block, message_delta and
message_stop, each a named server-sent event."""
from __future__ import annotations

import json
import secrets

from ..core.replies import CallArguments, CallStart, Delta, Reasoning, Text
from ..core.run import Run, Sample, Step
from ..errors import APIError
from ..sse import named_event
from ..exchange import Format
from ..state import ServerModel
from .request import MessagesRequest


def stop_reason(s: Sample, stops: tuple[str, ...], tokenizer) -> tuple[str, str | None]:
    """stop_reason and stop_sequence: a tool call, the token limit, the first stop sequence found in
    the generated text (as llama-server finds its stopping word), or the model's own end."""
    if s.reply is not None and s.reply.tool_calls:
        return "tool_use", None
    if s.finish_reason == "length":
        return "max_tokens", None
    raw = tokenizer.decode(s.tokens) if stops else ""
    hits = [(raw.find(w), w) for w in stops if w in raw]
    return ("stop_sequence", min(hits)[1]) if hits else ("end_turn", None)


def usage(s: Sample, prompt_tokens: int) -> dict:
    cached = s.cached_tokens
    return {"input_tokens": prompt_tokens - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": len(s.tokens)}


def tool_input(arguments: str):
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesReply(Format):
    def __init__(self, req: MessagesRequest, model: ServerModel):
        self.req, self.stream, self.tokenizer = req, req.stream, model.tokenizer
        self.id = "msg_" + secrets.token_hex(12)
        self.model = req.model or model.id
        self.block: object = None  # the open block: "text", "thinking" or a tool call's index
        self.index = -1

    def whole(self, run: Run, samples: list[Sample]) -> dict:
        s = samples[0]
        content: list[dict] = []
        if s.reply.reasoning:
            content.append({"type": "thinking", "thinking": s.reply.reasoning, "signature": ""})
        if s.reply.content:
            content.append({"type": "text", "text": s.reply.content})
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c.arguments)}
                    for c in s.reply.tool_calls]
        reason, sequence = stop_reason(s, self.req.gen.stop, self.tokenizer)
        return {**self._message(content), "stop_reason": reason, "stop_sequence": sequence,
                "usage": usage(s, s.prompt_tokens)}

    def _message(self, content: list) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": None, "stop_sequence": None}

    # ---- streaming ----
    def opening(self, run: Run):
        start = {**self._message([]), "usage": {"input_tokens": len(run.prompts[0]), "output_tokens": 0}}
        yield named_event("message_start", {"type": "message_start", "message": start})
        for d in run.opening[0]:
            yield from self._delta(d)

    def token(self, run: Run, step: Step):
        for d in step.deltas:
            yield from self._delta(d)

    def finish(self, run: Run, step: Step):
        for d in step.deltas:
            yield from self._delta(d)
        yield from self._close()
        s = step.sample
        reason, sequence = stop_reason(s, self.req.gen.stop, self.tokenizer)
        yield named_event("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": usage(s, s.prompt_tokens)})
        yield named_event("message_stop", {"type": "message_stop"})

    def failure(self, error: APIError) -> bytes:
        return named_event("error", {"type": "error", "error": {"type": error.type, "message": error.message}})

    def _delta(self, d: Delta):
        if isinstance(d, Text):
            yield from self._open("text", {"type": "text", "text": ""})
            yield self._block_delta({"type": "text_delta", "text": d.text})
        elif isinstance(d, Reasoning):
            yield from self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            yield self._block_delta({"type": "thinking_delta", "thinking": d.text})
        elif isinstance(d, CallStart):
            yield from self._close()
            yield from self._open(("call", d.index), {"type": "tool_use", "id": d.id, "name": d.name, "input": {}})
        elif isinstance(d, CallArguments) and d.text:
            yield self._block_delta({"type": "input_json_delta", "partial_json": d.text})

    def _open(self, kind, block: dict):
        if self.block == kind:
            return
        yield from self._close()
        self.block, self.index = kind, self.index + 1
        yield named_event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})

    def _close(self):
        if self.block is not None:
            yield named_event("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.block = None

    def _block_delta(self, delta: dict) -> bytes:
        return named_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
