"""Running llama.cpp's programs as the peer in benchmarks (separate processes, never linked).

The programs live in ../shared/llama.cpp (LLAMA_CPP_DIR overrides): `lib/<prog>.real` with
the AVX-512 build of the CPU kernels in `lib/` and the AVX2 build in `lib-avx2/`. Some
processors that report AVX-512 VNNI still fault in the AVX-512 build, so a run that dies
with SIGILL is retried on the AVX2 build; results say which build ran.
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def llama_cpp_dir() -> Path:
    return Path(os.environ.get("LLAMA_CPP_DIR", ROOT.parent / "shared" / "llama.cpp"))


def available() -> bool:
    return (llama_cpp_dir() / "lib" / "llama-bench.real").is_file()


def _env(build: str) -> dict:
    base = llama_cpp_dir()
    libs = [base / "lib"] if build == "avx512" else [base / "lib-avx2", base / "lib"]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(map(str, libs)) + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


_working_build: str | None = None


def run(prog: str, args: list[str], timeout: float = 1800, **kw) -> tuple[subprocess.CompletedProcess, str]:
    """Run llama.cpp's `prog` with `args`; returns the finished process and the build used."""
    global _working_build
    exe = str(llama_cpp_dir() / "lib" / f"{prog}.real")
    builds = [_working_build] if _working_build else ["avx512", "avx2"]
    for build in builds:
        proc = subprocess.run([exe, *args], env=_env(build), capture_output=True, text=True, timeout=timeout, **kw)
        if proc.returncode != -signal.SIGILL:
            _working_build = build
            return proc, build
    return proc, builds[-1]



def popen(prog: str, args: list[str], probe_model: str | None = None, **kw):
    """Start a long-running llama.cpp program (llama-server) on the build that works here.

    The build is found by a one-token llama-completion run on `probe_model` (a SIGILL shows
    only once kernels run), unless a benchmark already ran one."""
    if _working_build is None and probe_model:
        run("llama-completion", ["-m", probe_model, "-p", "hi", "-n", "1", "-no-cnv", "-t", "1"])
    build = _working_build or "avx2"
    exe = str(llama_cpp_dir() / "lib" / f"{prog}.real")
    return subprocess.Popen([exe, *args], env=_env(build), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
