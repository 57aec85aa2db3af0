"""Running llama.cpp's programs as the peer in benchmarks (separate processes, never linked).

The programs live in ../shared/llama.cpp (LLAMA_CPP_DIR overrides): `lib/<prog>.real`, with its
CPU kernels built as several variants in `lib/` (x64, haswell, skylakex, icelake, zen4, ...). At
start llama.cpp loads the best variant this processor supports and says which on stderr
(`load_backend: loaded CPU backend from .../libggml-cpu-zen4.so`); results name that variant.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_VARIANT = re.compile(r"load_backend: loaded CPU backend from \S*libggml-cpu-([\w.-]+?)\.so")


def llama_cpp_dir() -> Path:
    """LLAMA_CPP_DIR, or shared/llama.cpp beside the checkout (or beside the folder of worktrees it is in)."""
    if os.environ.get("LLAMA_CPP_DIR"):
        return Path(os.environ["LLAMA_CPP_DIR"])
    near = [ROOT.parent / "shared" / "llama.cpp", ROOT.parent.parent / "shared" / "llama.cpp"]
    return next((p for p in near if p.is_dir()), near[0])


def available() -> bool:
    return (llama_cpp_dir() / "lib" / "llama-bench.real").is_file()


def _env() -> dict:
    lib = str(llama_cpp_dir() / "lib")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


def variant(stderr: str) -> str:
    """The CPU kernel variant a llama.cpp run loaded ("zen4", "haswell", ...), from its stderr."""
    m = _VARIANT.search(stderr)
    return m.group(1) if m else "?"


def run(prog: str, args: list[str], timeout: float = 1800, **kw) -> tuple[subprocess.CompletedProcess, str]:
    """Run llama.cpp's `prog` with `args`; returns the finished process and the kernel variant it loaded."""
    exe = str(llama_cpp_dir() / "lib" / f"{prog}.real")
    proc = subprocess.run([exe, *args], env=_env(), capture_output=True, text=True, timeout=timeout, **kw)
    return proc, variant(proc.stderr)


def popen(prog: str, args: list[str], probe_model: str | None = None, **kw):
    """Start a long-running llama.cpp program (llama-server); probe_model is accepted for callers
    written for builds that had to be probed first, and not needed now."""
    exe = str(llama_cpp_dir() / "lib" / f"{prog}.real")
    return subprocess.Popen([exe, *args], env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)


def batched_bench(bin_dir: Path, path: Path, gpu: bool, n_streams: int, n_prompt: int = 512,
                  n_gen: int = 128, ubatch: int = 512) -> dict:
    """llama-batched-bench of the build in bin_dir (a GPU build: all layers on the GPU; else 2
    threads): n_streams sequences of n_prompt prompt tokens generating n_gen each, flash attention
    on, batches of 2048 tokens computed ubatch at a time; total, prompt and generation tokens/s."""
    args = [str(bin_dir / "llama-batched-bench"), "-m", str(path), "-c", str(n_streams * (n_prompt + n_gen) + 64),
            "-b", "2048", "-ub", str(ubatch), "-npp", str(n_prompt), "-ntg", str(n_gen), "-npl", str(n_streams),
            "-fa", "on"]
    args += ["-ngl", "99"] if gpu else ["-t", "2"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise RuntimeError(f"llama-batched-bench exited {p.returncode}: {p.stderr[-800:]}")
    # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
    for line in p.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and cells[0] == str(n_prompt) and cells[2] == str(n_streams):
            return {"total_tps": float(cells[9]), "pp_tps": float(cells[5]), "tg_tps": float(cells[7]),
                    "wall_s": float(cells[8])}
    raise RuntimeError(f"no result row in llama-batched-bench's output: {p.stdout[-800:]}")


def batched_best(bin_dir: Path, path: Path, gpu: bool, n_streams: int, n_prompt: int = 512, n_gen: int = 128,
                 ubatches: tuple = (512, 2048)) -> dict:
    """batched_bench at each of ubatches (batches of 2048 computed that many tokens at a time): the
    fastest run, with every run (or its error) under "by_ubatch"; raises where none ran."""
    runs = {}
    for ub in ubatches:
        try:
            runs[ub] = batched_bench(bin_dir, path, gpu, n_streams, n_prompt, n_gen, ub)
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # one setting failing leaves the others
            runs[ub] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    done = [r for r in runs.values() if "total_tps" in r]
    if not done:
        raise RuntimeError(f"llama-batched-bench failed at every ubatch: {runs}")
    return {**max(done, key=lambda r: r["total_tps"]), "by_ubatch": {str(ub): r for ub, r in runs.items()}}
