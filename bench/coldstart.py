"""Cold start of each way to install ember: process start to the first generated token of
`ember run smollm2 -p PROMPT -n 16 --temp 0`, and to the process's exit, beside llama.cpp's
llama-completion on the same file and prompt, in the same run.

Variants: the pip-installed wheel (a venv), the one-folder bundle, the one-file executable
(it unpacks itself to a temporary folder at every start), the zipapp on its first run (unpacked
into a fresh SHIV_ROOT) and on later runs (already unpacked). The artifacts come from
packaging/check.sh OUT (or build.py plus a venv with the wheel in OUT/wheel-venv). Runs go round
robin, one of each in turn, --reps times; medians. "Cold" means a new process each time with
the model file in the page cache (dropping the cache would disturb the machine's other users).
Ratios are to llama-completion (above 1: ember is slower) and to the pip install. Writes JSON to
bench/results/coldstart.json, with the load average before and after.

    python bench/coldstart.py --artifacts /tmp/ember-check [--reps 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer  # noqa: E402

from ember import hub  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = "The capital of France is"


def first_token(cmd: list[str], env: dict) -> tuple[float, float]:
    """Seconds from start to the first byte on stdout, and to exit."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    first = proc.stdout.read(1)
    t_first = time.perf_counter() - t0
    proc.stdout.read()
    if proc.wait() != 0 or not first:
        raise RuntimeError(f"{cmd[0]} failed with status {proc.returncode}")
    return t_first, time.perf_counter() - t0


def variants(art: Path, model: Path, threads: int, shiv_warm: Path) -> dict[str, tuple[list[str], dict]]:
    args = ["run", "smollm2", "-p", PROMPT, "-n", "16", "--temp", "0", "-t", str(threads)]
    env = {**os.environ, "EMBER_MODELS": str(model.parent)}
    python = os.path.realpath(sys._base_executable)
    (pyz,) = art.glob("ember-*.pyz")
    (folder,) = (p for p in art.glob("ember-*-linux-*") if p.is_dir())
    llama = [str(peer.llama_cpp_dir() / "lib" / "llama-completion.real"), "-m", str(model), "-p", PROMPT, "-n", "16",
             "--temp", "0", "-t", str(threads), "-no-cnv", "--no-display-prompt"]
    return {
        "pip install (wheel in a venv)": ([str(art / "wheel-venv/bin/ember"), *args], env),
        "one-folder bundle": ([str(folder / "ember"), *args], env),
        "one-file executable": ([str(art / "ember"), *args], env),
        "zipapp, first run": ([python, str(pyz), *args], env),  # SHIV_ROOT: a new folder each run
        "zipapp, unpacked": ([python, str(pyz), *args], {**env, "SHIV_ROOT": str(shiv_warm)}),
        "llama-completion": (llama, peer._env(peer._working_build or "avx2")),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifacts", type=Path, required=True, help="packaging/check.sh's output folder")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "coldstart.json")
    args = ap.parse_args()
    model = hub.resolve("smollm2")
    peer.run("llama-completion", ["-m", str(model), "-p", "hi", "-n", "1", "-no-cnv", "-t", "1"])  # its build here
    scratch = Path(tempfile.mkdtemp(prefix="ember-coldstart-"))
    try:
        table = measure(variants(args.artifacts, model, args.threads, scratch / "warm"), args.reps, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    sizes = {p.name: p.stat().st_size for p in sorted(args.artifacts.iterdir()) if p.is_file() and p.name != "SHA256SUMS"}
    report(table, sizes, args)
    return 0


def measure(cases: dict, reps: int, scratch: Path) -> dict[str, dict]:
    for cmd, env in cases.values():  # one untimed run each: files in the page cache, the zipapp unpacked once
        first_token(cmd, {**env, "SHIV_ROOT": env.get("SHIV_ROOT", str(scratch / "once"))})
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    load_before = os.getloadavg()
    for rep in range(reps):
        for name, (cmd, env) in cases.items():
            if name == "zipapp, first run":
                env = {**env, "SHIV_ROOT": str(scratch / f"fresh{rep}")}
            times[name].append(first_token(cmd, env))
    load_after = os.getloadavg()
    table = {name: {"first_token_s": statistics.median(t[0] for t in ts), "exit_s": statistics.median(t[1] for t in ts),
                    "runs": ts} for name, ts in times.items()}
    table["_load"] = {"before": load_before, "after": load_after}
    return table


def report(table: dict, sizes: dict, args) -> None:
    load = table.pop("_load")
    peer_s = table["llama-completion"]["first_token_s"]
    pip_s = table["pip install (wheel in a venv)"]["first_token_s"]
    print(f"cold start to the first token, 16 tokens of SmolLM2, {args.threads} threads, median of {args.reps} "
          f"(load average {load['before'][0]:.2f} before, {load['after'][0]:.2f} after, {os.cpu_count()} cores)")
    print(f"  {'':32} {'first token':>12} {'exit':>8} {'/ llama.cpp':>12} {'/ pip':>7}")
    for name, r in table.items():
        print(f"  {name:32} {r['first_token_s']:11.3f}s {r['exit_s']:7.3f}s {r['first_token_s'] / peer_s:11.2f}x "
              f"{r['first_token_s'] / pip_s:6.2f}x")
    print("sizes: " + ", ".join(f"{name} {size / 1e6:.1f} MB" for name, size in sizes.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": args.threads, "reps": args.reps, "load_average": load,
                                    "machine": platform.platform(), "llama_cpp_build": peer._working_build,
                                    "variants": table, "sizes_bytes": sizes}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
