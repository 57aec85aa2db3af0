"""POST /slots/{id}?action=save|restore, as llama-server has them: a slot's cached tokens and their
KV pages written to a file of --slot-save-path, or such a file loaded into the prefix cache (the
next prompt that starts with its tokens computes only the rest). Slots share one prefix cache
here (see engine/slotfile.py for which tokens a slot stands for)."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...engine.slotfile import SlotFileError, restore_slot, save_slot
from ..errors import invalid
from ..exchange import read
from ..fields import Fields
from ..state import ServerState


async def slot_file(request: Request, state: ServerState, slot: int, action: str) -> Response:
    folder = state.config.slot_save_path
    if folder is None:
        raise invalid("action", "slot save and restore need the server started with --slot-save-path", "unsupported")
    name = await read(request, _filename)
    engine = (await state.model_for_request()).engine
    path = Path(folder) / name
    run = (lambda: save_slot(engine, slot, path)) if action == "save" else (lambda: restore_slot(engine, path))
    t0 = time.perf_counter()
    try:
        io = await asyncio.wrap_future(engine.call(run))
    except SlotFileError as e:
        raise invalid("filename", str(e)) from None
    ms = (time.perf_counter() - t0) * 1000
    if action == "save":
        return JSONResponse({"id_slot": slot, "filename": name, "n_saved": io.n_tokens, "n_written": io.n_bytes,
                             "timings": {"save_ms": ms}})
    return JSONResponse({"id_slot": slot, "filename": name, "n_restored": io.n_tokens, "n_read": io.n_bytes,
                         "timings": {"restore_ms": ms}})


def _filename(body: Fields) -> str:
    """A plain file name: no folders, no way out of --slot-save-path."""
    name = body.str("filename")
    if not name:
        raise invalid("filename", "filename is required (a plain file name)", "missing_required_parameter")
    if "/" in name or "\\" in name or "\0" in name or name in (".", "..") or os.path.isabs(name):
        raise invalid("filename", f"filename must be a plain file name, without folders or '..', got {name!r}")
    return name
