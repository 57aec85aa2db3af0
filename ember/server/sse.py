"""Server-sent events, and noticing that the client went away.

Starlette's StreamingResponse only notices a disconnect when a write fails, which never
happens while a request waits in the engine's queue. `EventStream` listens for the ASGI
disconnect message itself and closes its event source at once; the source's cleanup cancels
the engine request, so the sequence and its pages are gone within one engine step.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable, TypeVar

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


def event(data: Any) -> bytes:
    """One SSE event carrying `data` as JSON."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def named_event(kind: str, data: Any) -> bytes:
    """One SSE event of type `kind` (an `event:` line, as Anthropic's and the Responses streams use)."""
    return f"event: {kind}\n".encode() + event(data)


DONE = b"data: [DONE]\n\n"


async def wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream:
    """An ASGI response streaming `events` (bytes, already SSE-framed) until they end or the
    client disconnects; either way the event source is closed before the call returns."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None):
        self.events = events
        self.headers = {"content-type": "text/event-stream", "cache-control": "no-cache",
                        "x-accel-buffering": "no", **(headers or {})}

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(k.encode(), v.encode()) for k, v in self.headers.items()]})
        pump = asyncio.ensure_future(self._pump(send))
        gone = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, gone):
                task.cancel()
            await asyncio.gather(pump, gone, return_exceptions=True)
            await self.events.aclose()

    async def _pump(self, send) -> None:
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def until_disconnect(receive, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task in done:
        return task.result()
    raise ClientGone()
