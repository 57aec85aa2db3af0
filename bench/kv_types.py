"""Quality of the quantized KV cache types next to llama.cpp's with the same types.

For each model and cache type (f16, q8_0, q4_0 for both K and V): perplexity of the first
chunks of a text in 512-token chunks, ember's and llama-perplexity's (flash attention on:
llama.cpp quantizes V only with it), and the KL divergence of each from the f16 logits
llama-perplexity wrote (llama.cpp's own f16 run is the base of both). Prints one JSON object.

    python bench/kv_types.py [--models smollm2 gemma3-270m] [--chunks 6] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer  # noqa: E402

from ember import hub  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "data" / "GPL-3.txt"
TYPES = ("f16", "q8_0", "q4_0")


def _number(pattern: str, text: str) -> float | None:
    m = re.search(pattern, text)
    return float(m.group(1)) if m else None


def llama_ppl(model: Path, t: str, threads: int, chunks: int, base: Path | None = None, write_base: bool = False):
    args = ["-m", str(model), "-f", str(TEXT), "-c", "512", "-b", "512", "-t", str(threads), "--chunks", str(chunks),
            "-ctk", t, "-ctv", t, "-fa", "on"]
    if base is not None:
        args += ["--kl-divergence-base", str(base)] + ([] if write_base else ["--kl-divergence"])
    proc, _ = peer.run("llama-perplexity", args)
    out = proc.stdout + proc.stderr
    return {"ppl": _number(r"Final estimate: PPL = ([\d.]+)", out) or _number(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", out),
            "kld": _number(r"Mean\s+KLD:\s+([-\d.]+)", out), "same_top": _number(r"Same top p:\s+([\d.]+)", out),
            "rc": proc.returncode}


def ember(args: list[str], threads: int) -> str:
    cmd = [sys.executable, "-m", "ember", "perplexity", *args, "--device", "cpu", "-t", str(threads)]
    return subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ)).stdout


def ember_ppl(model: Path, t: str, threads: int, chunks: int, base: Path):
    """Perplexity (PPL(Q)) and KL divergence over the base file's chunks, in one pass."""
    kld = ember([str(model), "--kl-divergence", "--kl-divergence-base", str(base), "--chunks", str(chunks),
                 "-ctk", t, "-ctv", t], threads)
    return {"ppl": _number(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", kld), "kld": _number(r"Mean\s+KLD:\s+([-\d.]+)", kld),
            "same_top": _number(r"Same top p:\s+([\d.]+)", kld)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    results = {"load_avg_start": os.getloadavg(), "chunks": a.chunks, "text": TEXT.name, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models:
            model = hub.resolve(name)
            base = Path(tmp) / f"{name}.kld"
            rows = results["models"][name] = {}
            f16 = llama_ppl(model, "f16", a.threads, a.chunks, base, write_base=True)  # the base: KLD 0
            for t in TYPES:  # ember and llama.cpp alternate
                rows[t] = {"ember": ember_ppl(model, t, a.threads, a.chunks, base),
                           "llama.cpp": f16 if t == "f16" else llama_ppl(model, t, a.threads, a.chunks, base)}
                print(name, t, rows[t], file=sys.stderr, flush=True)
    results["load_avg_end"] = os.getloadavg()
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
