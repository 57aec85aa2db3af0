"""The two ends every route shares: `read` turns a request's body into the route's typed request
(once, off the event loop), and `respond` writes a run back through the API's `Format`, as one
JSON reply or as a stream of server-sent events.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Iterable, TypeVar

from starlette.concurrency import run_in_threadpool as off_loop
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .core.run import Run, Sample, Step
from .errors import APIError
from .fields import Fields, parse_json_object
from .sse import ClientGone, EventStream, until_disconnect

T = TypeVar("T")


SMALL_BODY = 4096  # bytes: a body a route may parse on the loop (a thread-pool hop costs more)


async def read(request: Request, parse: Callable[..., T], *args) -> T:
    """`parse(body, *args)` of the request's JSON body, off the loop (a big body takes long to
    decode and check); 400 for a body that is not a JSON object or has a field wrong."""
    return await off_loop(parsed, await request.body(), parse, args)


def parsed(raw: bytes, parse: Callable[..., T], args: tuple) -> T:
    return parse(Fields(parse_json_object(raw)), *args)


class Format:
    """How an API writes a run back: `whole` for the finished samples (a JSON value), or, when
    `stream`, the events of its steps: `opening` before any, `token` and `finish` per step,
    `closing` after the last, and `failure` when a sample fails once the stream has begun."""

    stream: bool = False

    def whole(self, run: Run, samples: list[Sample]) -> Any:
        raise NotImplementedError

    def opening(self, run: Run) -> Iterable[bytes]:
        return ()

    def token(self, run: Run, step: Step) -> Iterable[bytes]:
        raise NotImplementedError

    def progress(self, run: Run, step: Step) -> Iterable[bytes]:
        return ()

    def finish(self, run: Run, step: Step) -> Iterable[bytes]:
        raise NotImplementedError

    def closing(self, run: Run) -> Iterable[bytes]:
        return ()

    def failure(self, error: APIError) -> bytes:
        return error.sse()


async def respond(request: Request, run: Run, fmt: Format) -> Response:
    """The run's reply; 499 (nothing sent) when the client leaves before a whole reply is ready."""
    if fmt.stream:
        return EventStream(_events(run, fmt))
    try:
        samples = await until_disconnect(request.receive, run.collect())
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse(fmt.whole(run, samples))


async def _events(run: Run, fmt: Format):
    try:
        for chunk in fmt.opening(run):
            yield chunk
        async for step in run:
            if step.error is not None:
                yield fmt.failure(step.error)
                return
            write = fmt.token if step.is_token else fmt.progress if step.is_progress else fmt.finish
            for chunk in write(run, step):
                yield chunk
        for chunk in fmt.closing(run):
            yield chunk
    finally:
        run.close()


async def json_reply(make: Callable[..., Any], *args) -> Response:
    """The JSON reply `make(*args)` computes, computed and rendered off the loop (a /tokenize of
    10 MB has millions of ids)."""
    return Response(await off_loop(_json_bytes, make, args), media_type="application/json")


def _json_bytes(make: Callable[..., Any], args: tuple) -> bytes:
    return json.dumps(make(*args), ensure_ascii=False, separators=(",", ":")).encode()
