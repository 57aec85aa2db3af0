"""Runs written back as Responses: output items (reasoning, message, function_call) with usage;
streamed as response.created, per item output_item.added, its deltas (output_text, reasoning_text,
function_call_arguments), their done events and output_item.done, then response.completed."""
from __future__ import annotations

import json
import secrets
import time

from ..core.replies import CallArguments, CallStart, Delta, Reasoning, Text
from ..core.run import Run, Sample, Step
from ..errors import APIError
from ..sse import named_event
from ..exchange import Format
from ..state import ServerModel
from .request import ResponsesRequest
from .store import ResponseStore


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def usage(s: Sample) -> dict:
    n = len(s.tokens)
    return {"input_tokens": s.prompt_tokens, "input_tokens_details": {"cached_tokens": s.cached_tokens},
            "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": s.prompt_tokens + n}


class ResponsesReply(Format):
    def __init__(self, req: ResponsesRequest, model: ServerModel, store: ResponseStore):
        self.req, self.store, self.stream = req, store, req.stream
        self.id, self.created = new_id("resp"), int(time.time())
        self.model = req.model or model.id
        self.seq = 0
        self.items: list[dict] = []  # streamed output items so far (the open one last)
        self.open_kind: object = None  # "message", "reasoning" or ("call", index)

    # ---- the response object ----
    def response(self, status: str, output: list, sample: Sample | None = None) -> dict:
        incomplete = sample is not None and sample.finish_reason == "length" and not sample.reply.tool_calls
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": "incomplete" if incomplete else status, "model": self.model, "output": output,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "previous_response_id": self.req.previous, "parallel_tool_calls": True, "tool_choice": "auto",
                "tools": [], "text": {"format": {"type": "text"}}, "error": None, "store": self.req.store,
                "usage": usage(sample) if sample is not None else None, "output_text": None,
                **{k: v for k, v in self.req.echo.items() if k != "metadata"}, "metadata": self.req.echo.get("metadata") or {}}

    def output_items(self, s: Sample) -> list[dict]:
        items = []
        if s.reply.reasoning:
            items.append(reasoning_item(new_id("rs"), s.reply.reasoning))
        if s.reply.content or not s.reply.tool_calls:
            items.append(message_item(new_id("msg"), s.reply.content or "", "completed"))
        items += [call_item(new_id("fc"), c.id, c.name, c.arguments, "completed") for c in s.reply.tool_calls]
        return items

    def whole(self, run: Run, samples: list[Sample]) -> dict:
        s = samples[0]
        out = self.response("completed", self.output_items(s), s)
        out["output_text"] = s.reply.content or ""
        self.remember(s, out)
        return out

    def remember(self, s: Sample, response: dict) -> None:
        if not self.req.store:
            return
        turn = {"role": "assistant", "content": s.reply.content or ""}
        if s.reply.reasoning:
            turn["reasoning_content"] = s.reply.reasoning
        if s.reply.tool_calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                  for c in s.reply.tool_calls]
        self.store.put(self.id, [*self.req.messages, turn], response)

    # ---- streaming ----
    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return named_event(kind, data)

    def opening(self, run: Run):
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
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
        final = self.response("completed", self.items, s)
        self.remember(s, final)
        # response.completed also when the status says incomplete: clients (the openai library's
        # stream helper, Codex) wait for that event to end the response
        yield self.event("response.completed", response=final)

    def failure(self, error: APIError) -> bytes:
        return self.event("error", code=error.code, message=error.message, param=error.param)

    def _delta(self, d: Delta):
        if isinstance(d, Text) and d.text:
            yield from self._open("message", lambda: message_item(new_id("msg"), "", "in_progress"))
            item = self.items[-1]
            item["content"][0]["text"] += d.text
            yield self.event("response.output_text.delta", item_id=item["id"], output_index=len(self.items) - 1,
                             content_index=0, delta=d.text, logprobs=[])
        elif isinstance(d, Reasoning) and d.text:
            yield from self._open("reasoning", lambda: reasoning_item(new_id("rs"), ""))
            item = self.items[-1]
            item["content"][0]["text"] += d.text
            yield self.event("response.reasoning_text.delta", item_id=item["id"], output_index=len(self.items) - 1,
                             content_index=0, delta=d.text)
        elif isinstance(d, CallStart):
            yield from self._close()
            yield from self._open(("call", d.index), lambda: call_item(new_id("fc"), d.id, d.name, "", "in_progress"))
        elif isinstance(d, CallArguments) and d.text:
            item = self.items[-1]
            item["arguments"] += d.text
            yield self.event("response.function_call_arguments.delta", item_id=item["id"],
                             output_index=len(self.items) - 1, delta=d.text)

    def _open(self, kind, make):
        if self.open_kind == kind:
            return
        yield from self._close()
        item = make()
        self.items.append(item)
        self.open_kind = kind
        index = len(self.items) - 1
        shown = {**item, "content": []} if item["type"] == "message" else item
        yield self.event("response.output_item.added", output_index=index, item=json.loads(json.dumps(shown)))
        if item["type"] == "message":
            yield self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": []})

    def _close(self):
        if self.open_kind is None:
            return
        item, index = self.items[-1], len(self.items) - 1
        if item["type"] == "message":
            part = item["content"][0]
            yield self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                             text=part["text"], logprobs=[])
            yield self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                             part=part)
        elif item["type"] == "reasoning":
            yield self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                             text=item["content"][0]["text"])
        else:
            yield self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             arguments=item["arguments"], name=item["name"])
        if "status" in item:  # messages and calls (reasoning items have none)
            item["status"] = "completed"
        yield self.event("response.output_item.done", output_index=index, item=item)
        self.open_kind = None


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}
