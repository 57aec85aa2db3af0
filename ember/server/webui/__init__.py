"""The chat page served at `/` (index.html, app.js, render.js, style.css): plain files shipped in
the package, no build step and nothing fetched from the network."""
from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response

from ..errors import APIError

TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8"}
FILES = ("index.html", "app.js", "render.js", "style.css")
OPEN = frozenset({"/", *(f"/webui/{name}" for name in FILES)})  # served without an API key: the page asks for it


def _file(name: str) -> Response:
    body = resources.files(__name__).joinpath(name).read_bytes()
    return Response(body, media_type=TYPES[name[name.rindex("."):]], headers={"cache-control": "no-cache"})


async def index(request: Request) -> Response:
    return _file("index.html")


async def static(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in FILES:
        raise APIError(404, f"no file {name!r} in the chat page", code="not_found")
    return _file(name)
