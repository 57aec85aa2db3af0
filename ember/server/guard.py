"""ASGI middleware in front of every route: API keys and the request body size limit."""
from __future__ import annotations

import hmac
import json

from .errors import APIError

OPEN_PATHS = frozenset({"/health", "/v1/health"})  # answer without a key (load balancers, probes)


class Guard:
    """Refuses requests without a valid API key (401) and bodies over the limit (413)."""

    def __init__(self, app, api_keys: tuple[str, ...], max_body_bytes: int):
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.max_body = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        error = self._refusal(scope, headers)
        if error is not None:
            return await send_error(send, error)
        await self.app(scope, self._limited(receive), send)

    def _refusal(self, scope, headers: dict[bytes, bytes]) -> APIError | None:
        if self.keys and scope["method"] != "OPTIONS" and scope["path"] not in OPEN_PATHS \
                and not self._authorized(headers):
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
