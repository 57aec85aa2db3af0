"""ASGI middleware in front of every route: the Host and Origin checks (origins.py), CORS
headers and preflights as llama-server sends them, API keys and the request body size limit."""
from __future__ import annotations

import hmac
import json

from .errors import APIError
from .origins import host_allowed, origin_allowed

from .webui import OPEN as PAGE_PATHS

# answer without a key: load balancers and probes; the chat page's files (the page asks for the key)
OPEN_PATHS = frozenset({"/health", "/v1/health"}) | PAGE_PATHS
CORS_METHODS = b"GET, POST, DELETE, OPTIONS"


class Guard:
    """Refuses requests naming a Host not served (403), from an Origin not allowed (403), without
    a valid API key (401) and with bodies over the limit (413); answers CORS preflights and adds
    CORS headers to the replies to allowed origins."""

    def __init__(self, app, api_keys: tuple[str, ...], max_body_bytes: int, allowed_hosts: tuple[str, ...],
                 cors_origins: tuple[str, ...]):
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.max_body = max_body_bytes
        self.hosts = tuple(h.lower() for h in allowed_hosts)
        self.origins = tuple(o.lower().rstrip("/") for o in cors_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        host = headers.get(b"host")
        if host is not None and not host_allowed(host.decode("latin-1"), self.hosts):
            return await send_error(send, APIError(
                403, f"Host {host.decode('latin-1')!r} is not served here; start the server with --allowed-hosts "
                     "naming it (a guard against DNS rebinding)", type="permission_error", code="host_not_allowed"))
        origin = headers.get(b"origin")
        allowed = origin is not None and origin_allowed(origin.decode("latin-1"), self.origins)
        cors = [(b"access-control-allow-origin", origin), (b"access-control-allow-credentials", b"true"),
                (b"vary", b"Origin")] if allowed else []
        if scope["method"] == "OPTIONS":
            return await self._preflight(send, headers, cors)
        if origin is not None and not allowed:
            return await send_error(send, APIError(
                403, f"requests from the web origin {origin.decode('latin-1')!r} are not allowed; start the server "
                     "with --cors-origin naming it", type="permission_error", code="origin_not_allowed"))
        send = _with_headers(send, cors)
        error = self._refusal(scope, headers)
        if error is not None:
            return await send_error(send, error)
        await self.app(scope, self._limited(receive), send)

    @staticmethod
    async def _preflight(send, headers: dict[bytes, bytes], cors: list) -> None:
        """200 to every OPTIONS, as llama-server answers; the allow-origin header only for an
        allowed origin. Headers: "*" covers any header but Authorization, and is read literally
        for credentialed requests, so the requested ones are named as well."""
        wanted = headers.get(b"access-control-request-headers")
        out = cors + [(b"access-control-allow-methods", CORS_METHODS),
                      (b"access-control-allow-headers", b"*, " + wanted if wanted else b"*"),
                      (b"access-control-max-age", b"600"), (b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 200, "headers": out})
        await send({"type": "http.response.body", "body": b""})

    def _refusal(self, scope, headers: dict[bytes, bytes]) -> APIError | None:
        if self.keys and scope["path"] not in OPEN_PATHS and not self._authorized(headers):
            return APIError(401, "invalid or missing API key (send Authorization: Bearer KEY or X-Api-Key: KEY)",
                            type="authentication_error", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return too_large(self.max_body)
        return None

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        given = headers.get(b"x-api-key") or _bearer(headers.get(b"authorization", b""))
        if not given:
            return False
        # compare with every key, so the time taken does not tell which one matched
        matches = [hmac.compare_digest(given, key) for key in self.keys]
        return any(matches)

    def _limited(self, receive):
        """receive() that fails once the body grows past the limit (bodies without a length)."""
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise too_large(self.max_body)
            return message

        return limited


def _with_headers(send, extra: list[tuple[bytes, bytes]]):
    if not extra:
        return send

    async def sending(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *extra]}
        await send(message)

    return sending


def _bearer(value: bytes) -> bytes:
    scheme, _, token = value.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="body_too_large")


async def send_error(send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
