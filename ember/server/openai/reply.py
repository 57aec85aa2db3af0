"""Runs written back in OpenAI's shapes: chat.completion (and its chunks), text_completion, and
the model list. Replies carry llama-server's `timings` as well, as llama-server sends them, and
name the served model whatever name the request gave.
"""
from __future__ import annotations

import secrets
import time

from ...engine import TokenEvent
from ..core.prompts import token_piece
from ..core.replies import CallStart, Delta, Text, ToolCall
from ..core.run import Run, Sample, Step
from ..exchange import Format
from ..llamacpp.reply import timings
from ..sse import DONE, event
from ..state import ModelInfo, ServerModel, ServerState
from .request import ChatRequest, CompletionRequest

FINGERPRINT = "ember"


def meta(prefix: str, model: ServerModel) -> dict:
    return {"id": f"{prefix}-{secrets.token_hex(12)}", "created": int(time.time()), "model": model.id,
            "system_fingerprint": FINGERPRINT}


def finish_reason(sample: Sample) -> str:
    if sample.reply is not None and sample.reply.tool_calls:
        return "tool_calls"
    return "length" if sample.finish_reason == "length" else "stop"


def usage(samples: list[Sample], n: int) -> dict:
    """OpenAI's usage block; each prompt counts once however many samples share it."""
    firsts = samples[::n]
    prompt = sum(s.prompt_tokens for s in firsts)
    cached = sum(min(x.cached_tokens for x in samples[i:i + n]) for i in range(0, len(samples), n))
    completion = sum(len(s.tokens) for s in samples)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# ---- chat ----

def call_json(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def delta_json(d: Delta) -> dict:
    if isinstance(d, Text):
        return {"content": d.text}
    if isinstance(d, CallStart):
        return {"tool_calls": [{"index": d.index, **call_json(ToolCall(d.id, d.name, ""))}]}
    return {"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]}


def merged(deltas: list[Delta]) -> dict:
    """Several deltas of one token as one (for chunks that carry that token's logprobs)."""
    out: dict = {}
    for d in map(delta_json, deltas):
        if "content" in d:
            out["content"] = out.get("content", "") + d["content"]
        if "tool_calls" in d:
            out.setdefault("tool_calls", []).extend(d["tool_calls"])
    return out


def _token_logprob(model: ServerModel, token: int, logprob: float) -> dict:
    piece = token_piece(model, token)
    return {"token": piece.decode("utf-8", "replace"), "logprob": float(logprob), "bytes": list(piece)}


def chat_logprobs(model: ServerModel, ev: TokenEvent) -> dict:
    entry = _token_logprob(model, ev.token, ev.logprob)
    entry["top_logprobs"] = [_token_logprob(model, t, lp) for t, lp in ev.top_logprobs or ()]
    return entry


class ChatReply(Format):
    """chat.completion; streamed as llama-server sends it: a first delta with the role and
    `content: null`, the content, each choice's finish, and `timings` on the last chunk (the
    usage chunk, if asked)."""

    def __init__(self, req: ChatRequest, model: ServerModel):
        self.req, self.model, self.stream = req, model, req.stream
        self.meta = meta("chatcmpl", model)

    def whole(self, run: Run, samples: list[Sample]) -> dict:
        return {**self.meta, "object": "chat.completion", "choices": [self._choice(s) for s in samples],
                "usage": usage(samples, run.n), "timings": timings(samples[0], run.submitted)}

    def _choice(self, s: Sample) -> dict:
        message = {"role": "assistant", "content": s.reply.content}
        if s.reply.tool_calls:
            message["tool_calls"] = [call_json(c) for c in s.reply.tool_calls]
        logprobs = {"content": [chat_logprobs(self.model, ev) for ev in s.logprobs]} \
            if self.req.gen.logprobs is not None else None
        return {"index": s.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason(s)}

    def _chunk(self, index: int, delta: dict, finish: str | None = None, logprobs=None, **extra) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return event({**self.meta, "object": "chat.completion.chunk", "choices": [choice], **extra})

    def opening(self, run: Run):
        for i, deltas in enumerate(run.opening):
            yield self._chunk(i, {"role": "assistant", "content": None})
            for d in deltas:  # the message the reply continues
                yield self._chunk(i, delta_json(d))

    def token(self, run: Run, step: Step):
        if self.req.gen.logprobs is not None:
            yield self._chunk(step.index, merged(step.deltas),
                              logprobs={"content": [chat_logprobs(self.model, step.event)]})
            return
        for d in step.deltas:
            yield self._chunk(step.index, delta_json(d))

    def finish(self, run: Run, step: Step):
        for d in step.deltas:
            yield self._chunk(step.index, delta_json(d))
        extra = {} if self.req.include_usage else {"timings": timings(step.sample, run.submitted)}
        yield self._chunk(step.index, {}, finish_reason(step.sample), **extra)

    def closing(self, run: Run):
        if self.req.include_usage:
            yield event({**self.meta, "object": "chat.completion.chunk", "choices": [],
                         "usage": usage(run.samples, run.n), "timings": timings(run.samples[0], run.submitted)})
        yield DONE


# ---- legacy completions ----

def completion_logprobs(model: ServerModel, events: list[TokenEvent], offset: int = 0) -> dict:
    """The legacy completions logprobs block."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ev in events:
        text = token_piece(model, ev.token).decode("utf-8", "replace")
        out["tokens"].append(text)
        out["token_logprobs"].append(float(ev.logprob))
        out["top_logprobs"].append({token_piece(model, t).decode("utf-8", "replace"): float(lp)
                                    for t, lp in ev.top_logprobs or ()})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


class CompletionReply(Format):
    """text_completion, whole or as chunks of text."""

    def __init__(self, req: CompletionRequest, model: ServerModel):
        self.req, self.model, self.stream = req, model, req.stream
        self.meta = meta("cmpl", model)
        self.offsets: dict[int, int] = {}  # streamed text per choice, for text_offset

    def whole(self, run: Run, samples: list[Sample]) -> dict:
        choices = [{"index": s.index, "text": s.text, "finish_reason": finish_reason(s),
                    "logprobs": completion_logprobs(self.model, s.logprobs) if self._logprobs else None}
                   for s in samples]
        return {**self.meta, "object": "text_completion", "choices": choices, "usage": usage(samples, run.n),
                "timings": timings(samples[0], run.submitted)}

    @property
    def _logprobs(self) -> bool:
        return self.req.gen.logprobs is not None

    def _chunk(self, index: int, text: str, finish: str | None = None, logprobs=None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return event({**self.meta, "object": "text_completion", "choices": [choice]})

    def token(self, run: Run, step: Step):
        ev, offset = step.event, self.offsets.get(step.index, 0)
        lp = completion_logprobs(self.model, [ev], offset) if self._logprobs else None
        self.offsets[step.index] = offset + len(ev.text)
        if ev.text or lp:
            yield self._chunk(step.index, ev.text, logprobs=lp)

    def finish(self, run: Run, step: Step):
        yield self._chunk(step.index, step.event.text, finish_reason(step.sample))

    def closing(self, run: Run):
        if self.req.include_usage:
            yield event({**self.meta, "object": "text_completion", "choices": [], "usage": usage(run.samples, run.n)})
        yield DONE


# ---- models ----

def models_reply(info: ModelInfo, state: ServerState) -> dict:
    """llama-server's reply: OpenAI's list (with aliases and tags) and Ollama's `models`."""
    figures = {"n_vocab": info.n_vocab, "n_ctx_train": info.n_ctx_train, "n_ctx": info.n_ctx, "size": info.size}
    tags = list(state.config.tags)
    return {"object": "list", "data": [
        {"id": info.id, "aliases": list(info.aliases), "tags": tags, "object": "model", "created": int(state.started),
         "owned_by": "ember", "meta": figures}],
        "models": [{"name": info.id, "model": info.id, "modified_at": "", "size": str(info.size), "digest": "",
                    "type": "model", "description": "", "tags": tags, "capabilities": ["completion"],
                    "parameters": "", "details": {"parent_model": "", "format": "gguf", "family": "",
                                                  "families": [], "parameter_size": "", "quantization_level": ""}}]}
