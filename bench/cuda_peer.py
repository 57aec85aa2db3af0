"""ember beside llama.cpp's CUDA build on the same files, in the same run, at the shapes people run:
Llama-3.1-8B (Q4_K, Q8_0, the Q4_K_M mix), Qwen3-30B-A3B (Q4_K_M, 128 experts, 8 active) and
gpt-oss-20b (MXFP4 experts, attention sinks). For each file, ember then llama.cpp:

  - pp512 and tg128 of one stream (ember through the engine; llama.cpp's llama-bench, flash attention on);
  - 64 streams of 512 prompt + 128 generated tokens, total tokens/s (llama-batched-bench -npl 64);
  - the weight bytes a decode token reads (experts: the active share) and tg's read rate against the
    measured device copy bandwidth.

The files are synthetic (random blocks at the real shapes: bench/cuda.py's write_big_model for the
dense ones, tests/families.py at the family's real shape for the MoE ones, SmolLM2's vocabulary in
place of the family's own), written into a temporary folder one at a time and deleted after.

    python bench/cuda_peer.py --llama-bin DIR [--models llama8b-Q4_K llama8b-Q8_0 ...] [--profile] [--out FILE]

DIR holds llama-bench and llama-batched-bench of a CUDA build (bench/cuda_peer_device.sh builds them
from llama.cpp's sources on the GPU machine). --device cpu runs the same comparison on the CPU
backend (a check of the harness on a small shape: --models tiny).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))

import numpy as np  # noqa: E402

from ember.engine import LLM  # noqa: E402
from ember.gguf_loader import GGUFFile  # noqa: E402
from ember.sampler import SamplingParams  # noqa: E402



def _bench_module(name: str):
    """bench/NAME.py by path (a module named `cuda` on sys.path would shadow NVIDIA's package)."""
    spec = importlib.util.spec_from_file_location(f"ember_bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


bc, ladder, peer = _bench_module("cuda"), _bench_module("ladder"), _bench_module("peer")

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
LLAMA_8B = {"n_layer": 32, "d_model": 4096, "d_ff": 14336, "n_head": 32, "n_kv_head": 8, "head_dim": 128,
            "n_vocab": 128256}
TINY = {"n_layer": 2, "d_model": 256, "d_ff": 512, "n_head": 4, "n_kv_head": 2, "head_dim": 64, "n_vocab": 4096}
MODELS = {  # name: (writer, argument)
    "llama8b-Q4_K": ("dense", ("Q4_K", LLAMA_8B)),
    "llama8b-Q8_0": ("dense", ("Q8_0", LLAMA_8B)),
    "llama8b-Q4_K_M": ("dense", ("Q4_K_M", LLAMA_8B)),
    "qwen3-30b-a3b": ("family", "qwen3moe"),
    "gpt-oss-20b": ("family", "gpt-oss"),
    # 12 of the 48 layers (a quarter of the 4 minutes the whole file takes to write): for --profile,
    # whose step is the same launches layer after layer
    "qwen3-30b-a3b-12l": ("family", ("qwen3moe", 12)),
    "tiny": ("dense", ("Q4_K", TINY)),
}


def write(path: Path, name: str) -> None:
    kind, arg = MODELS[name]
    if kind == "dense":  # with a SentencePiece vocabulary of the shape's size, which both programs load
        qtype, shape = arg
        bc.write_big_model(path, qtype, shape, metadata=lambda w: ladder.add_vocab(w, shape["n_vocab"]))
    else:
        from families import write_family
        family, n_layer = arg if isinstance(arg, tuple) else (arg, 0)
        write_family(path, family, real_shape=True, n_layer=n_layer)


def token_bytes(path: Path) -> int:
    """Weight bytes one decode token reads: every layer tensor (stacked experts: the share of the
    active ones) and the output head (the token embedding where the file has none); the embedding
    lookup reads one row."""
    with GGUFFile(path) as f:
        arch = f.get("general.architecture")
        n_exp, n_used = f.get(f"{arch}.expert_count", 0), f.get(f"{arch}.expert_used_count", 0)
        tensors = f.tensors.values() if isinstance(f.tensors, dict) else f.tensors
        names = {t.name for t in tensors}
        head = "output.weight" if "output.weight" in names else "token_embd.weight"
        total = 0
        for t in tensors:
            if t.name == head or t.name.startswith("blk."):
                share = n_used / n_exp if "_exps" in t.name and n_exp else 1.0
                total += int(t.nbytes * share)
    return total


def ember_single(path: Path, device: str, reps: int) -> dict:
    rng = np.random.default_rng(0)
    with LLM(str(path), device=device, slots=1, ctx=512 + 128 + 8, prefix_cache=False) as llm:
        v = llm.model.n_vocab
        llm.generate(rng.integers(0, v, 512).tolist(), 4, GREEDY)  # warm-up: kernels, recordings
        llm.generate([int(rng.integers(v))], 8, GREEDY)
        pp, tg = [], []
        for _ in range(reps):
            c = llm.generate(rng.integers(0, v, 512).tolist(), 1, GREEDY)
            pp.append(512 / c.timings.prompt_s)
            c = llm.generate([int(rng.integers(v))], 128 + 1, GREEDY)
            tg.append(c.timings.generation_tps)
    return {"pp512": float(np.median(pp)), "tg128": float(np.median(tg)), "pp_runs": pp, "tg_runs": tg}


def ember_many(path: Path, device: str) -> dict:
    if device != "cuda":
        raise ValueError("the 64-stream runs are measured on the GPU only (--skip many)")
    r = bc.many_streams(str(path), 64, 512, 128, False)
    return {k: r[k] for k in ("total_tps", "gen_tps", "wall_s", "generated", "decode_replay_ms", "decode_steps")}


def llama_bench(bin_dir: Path, path: Path, reps: int, gpu: bool) -> dict:
    args = [str(bin_dir / "llama-bench"), "-m", str(path), "-p", "512", "-n", "128", "-r", str(reps), "-fa", "1",
            "-o", "json"]
    args += ["-ngl", "99"] if gpu else ["-t", "2"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise RuntimeError(f"llama-bench exited {p.returncode}: {p.stderr[-800:]}")
    rows = json.loads(p.stdout)
    out = {}
    for r in rows:
        key = "pp512" if r.get("n_prompt") == 512 and not r.get("n_gen") else "tg128"
        out[key] = float(r["avg_ts"])
        out[key + "_runs"] = r.get("samples_ts")
    out["build"] = rows[0].get("build_commit") if rows else None
    return out


def free_device_pools(gpu: bool) -> None:
    """The device memory CuPy's pools keep after ember's runs, given back before llama.cpp's: it
    fits its buffers to the memory it finds free (bench/NOTES.md, 2026-12-07)."""
    if gpu:
        import cupy as cp

        cp.get_default_memory_pool().free_all_blocks()
        cp.get_default_pinned_memory_pool().free_all_blocks()


def guarded(out: dict, key: str, fn, *args) -> None:
    t0 = time.perf_counter()
    try:
        out[key] = fn(*args)
    except Exception as e:  # one failure must not cost the other measurements of the run
        traceback.print_exc()
        out[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    print(f"  {key}: {json.dumps(out[key], default=str)[:300]} ({time.perf_counter() - t0:.0f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", type=Path, default=None, help="folder of llama-bench and llama-batched-bench")
    ap.add_argument("--models", nargs="*", default=["llama8b-Q4_K", "llama8b-Q8_0", "llama8b-Q4_K_M",
                                                     "qwen3-30b-a3b", "gpt-oss-20b"], choices=sorted(MODELS))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip", nargs="*", default=[], help="parts to skip: many (the 64-stream runs), peer")
    ap.add_argument("--profile", action="store_true",
                    help="also a decode step of one token and a prompt step of 512, each recorded and replayed "
                         "alone, each launch timed alone (where the step's time goes; GPU only)")
    ap.add_argument("--dir", type=Path, default=None, help="where the files are written (default: a temporary one)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cuda_peer.json")
    args = ap.parse_args()
    gpu = args.device == "cuda"
    results: dict = {"device": args.device, "models": {}}
    if gpu:
        import cupy as cp
        results["copy_gbs"] = bc.copy_bandwidth(cp)
        print(f"device copy bandwidth {results['copy_gbs']:.0f} GB/s", flush=True)
    n_streams = 64 if gpu else 8
    with tempfile.TemporaryDirectory(dir=args.dir or "/tmp") as tmp:
        for name in args.models:
            path = Path(tmp) / f"{name}.gguf"
            t0 = time.perf_counter()
            write(path, name)
            r = results["models"][name] = {"file_bytes": path.stat().st_size, "token_bytes": token_bytes(path),
                                            "write_s": time.perf_counter() - t0}
            print(f"{name}: {r['file_bytes'] / 1e9:.2f} GB, {r['token_bytes'] / 1e9:.2f} GB a token, written in "
                  f"{r['write_s']:.0f} s", flush=True)
            guarded(r, "ember_single", ember_single, path, args.device, args.reps)
            if args.profile and gpu:
                guarded(r, "ember_step", bc.decode_bandwidth, path, r["token_bytes"], results["copy_gbs"], 50, 0, True)
                guarded(r, "ember_prompt_step", bc.prompt_profile, path, 512)
            if "peer" not in args.skip and args.llama_bin:
                free_device_pools(gpu)
                guarded(r, "llama_single", llama_bench, args.llama_bin, path, args.reps, gpu)
            if "many" not in args.skip:
                guarded(r, "ember_many", ember_many, path, args.device)
                if "peer" not in args.skip and args.llama_bin:
                    free_device_pools(gpu)
                    guarded(r, "llama_many", peer.batched_best, args.llama_bin, path, gpu, n_streams)
            path.unlink()
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2, default=str))  # after each model: partial runs count
    print_table(results)


def print_step(name: str, step: dict) -> None:
    """A profiled decode step: its replay and GPU time, then the kernels by their time alone."""
    prof = step.get("profile") or {}
    print(f"{name}: decode step replayed {step['step_ms']:.3f} ms (GPU {step['gpu_step_ms']:.3f} ms), "
          f"{step['launches_per_step']} launches, {100 * step['fraction_of_copy']:.0f}% of copy; "
          f"kernels alone sum {prof.get('sum_us', 0):.0f} us:")
    print_kernels(prof)


def print_kernels(prof: dict, most: int = 12) -> None:
    """A launch profile's kernels, the costliest first."""
    for kernel, (n, us) in list(prof.get("kernels", {}).items())[:most]:
        print(f"    {kernel:32} {n:4d} launches {us:9.1f} us")


def print_table(results: dict) -> None:
    copy = results.get("copy_gbs")
    print(f"\n{'model':16} {'test':8} {'ember':>9} {'llama.cpp':>9} {'ratio':>6}  tg read (GB/s, % of copy)")
    for name, r in results["models"].items():
        for test, e_key, l_key, field in (("pp512", "ember_single", "llama_single", "pp512"),
                                          ("tg128", "ember_single", "llama_single", "tg128"),
                                          ("64x640", "ember_many", "llama_many", "total_tps")):
            e = r.get(e_key, {}).get(field)
            p = r.get(l_key, {}).get(field)
            ratio = f"{e / p:6.2f}" if e and p else "     -"
            extra = ""
            if test == "tg128" and e:
                gbs = e * r["token_bytes"] / 1e9
                extra = f"  ember {gbs:.0f}" + (f" ({100 * gbs / copy:.0f}%)" if copy else "")
                if p:
                    pg = p * r["token_bytes"] / 1e9
                    extra += f", llama.cpp {pg:.0f}" + (f" ({100 * pg / copy:.0f}%)" if copy else "")
            fmt = lambda x: f"{x:9.1f}" if x else "        -"  # noqa: E731
            print(f"{name:16} {test:8} {fmt(e)} {fmt(p)} {ratio}{extra}")
    for name, r in results["models"].items():
        if "step_ms" in r.get("ember_step", {}):
            print_step(name, r["ember_step"])
        p = r.get("ember_prompt_step", {})
        if "step_ms" in p:
            prof = p["profile"]
            print(f"{name}: prompt step of {p['tokens']} replayed {p['step_ms']:.2f} ms ({p['tokens_per_s']:.0f} tok/s), "
                  f"{p['launches_per_step']} launches; kernels alone sum {prof.get('sum_us', 0):.0f} us:")
            print_kernels(prof)


if __name__ == "__main__":
    main()
