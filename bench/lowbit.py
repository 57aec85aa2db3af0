"""Speed of the low-bit types (IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S TQ1_0 TQ2_0): ember beside
llama.cpp (llama-bench) on the same file, in the same run.

Per type, a llama-architecture file at Llama-3.2-1B's layer shapes (d 2048, ffn 8192, 32 heads of 64,
8 KV heads) with a few layers and a small tied Q8_0 vocabulary, every layer matrix in that type, so
that prompt processing and generation are nearly all products of that type: pp (a prompt in one
batch) and tg (tokens one at a time), ember's and llama.cpp's runs alternating, medians of --reps,
ratio ember / llama.cpp (above 1: ember is faster). Files are written once into
~/.cache/ember/bench (EMBER_BENCH_MODELS overrides). Writes JSON to bench/results/lowbit.json.
llama.cpp's threads spin while waiting: run on an otherwise idle machine (the load is printed).

--cpu-time, for a machine others are using: one thread each, and tokens per second of CPU time
the process used (ember's own process time; llama-bench's as a child, its load and warm-up taken
out by differencing a run of 1 + reps repetitions against one of 1) instead of wall time, which
another process's load makes meaningless. One thread never waits for another, so llama.cpp's
spinning adds nothing.

    python bench/lowbit.py [--types IQ2_XXS TQ2_0 ...] [--threads 2] [--reps 3] [--n-prompt 128] [--n-gen 32]
                           [--cpu-time]
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
import cpu as cpu_bench  # noqa: E402
import ladder  # noqa: E402
import peer  # noqa: E402
from synth import weight  # noqa: E402

from ember.engine import LLM  # noqa: E402
from ember.quant import GGMLType, layout, quantize  # noqa: E402

TYPES = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"]
SHAPE = ladder.Shape("lowbit", n_layer=4, d_model=2048, d_ff=8192, n_head=32, n_kv_head=8, head_dim=64,
                     n_vocab=512, tied=True)


def path_for(qtype: GGMLType) -> Path:
    return ladder.cache_dir() / f"lowbit-{qtype.name.lower()}-synthetic.gguf"


def ensure(qtype: GGMLType) -> Path:
    path = path_for(qtype)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write(tmp, qtype)
        tmp.rename(path)
    return path


def write(path: Path, qtype: GGMLType) -> None:
    """SHAPE's layers with every matrix of `qtype` (values spread about 0.02), a Q8_0 tied embedding."""
    import gguf

    s, rng = SHAPE, np.random.default_rng(int(qtype))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"synthetic {qtype.name}")
    w.add_block_count(s.n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(s.d_model)
    w.add_feed_forward_length(s.d_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_kv_head)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s.n_vocab)
    ladder.add_vocab(w, s.n_vocab)
    for name, n in ladder.norms(s):
        w.add_tensor(name, np.ones(n, np.float32))
    emb = quantize(rng.normal(0, 0.02, (s.n_vocab, s.d_model)).astype(np.float32), GGMLType.Q8_0)
    w.add_tensor("token_embd.weight", emb, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    for name, _, rows, cols in ladder.matrices(s):
        if name.startswith("blk."):
            w.add_tensor(name, weight(rng, qtype, rows, cols, 0.02), raw_dtype=gguf.GGMLQuantizationType(int(qtype)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def ember_cpu_speeds(path: Path, reps: int, n_prompt: int, n_gen: int) -> dict:
    """ember on one thread: prompt and generated tokens per second of this process's CPU time."""
    llm = LLM(str(path), device="cpu", threads=1, ctx=n_prompt + n_gen + 16, batch=n_prompt)
    rng = np.random.default_rng(0)
    llm.evaluate(rng.integers(0, 512, n_prompt).tolist(), cpu_bench.ignore, logits_from=n_prompt - 1)
    pp, tg = [], []
    for _ in range(reps):
        prompt = rng.integers(0, 512, n_prompt).tolist()
        t0 = time.process_time()
        llm.evaluate(prompt, cpu_bench.ignore, logits_from=n_prompt - 1)
        t1 = time.process_time()
        llm.generate([int(rng.integers(512))], n_gen, cpu_bench.GREEDY)
        t2 = time.process_time()
        pp.append(n_prompt / (t1 - t0))
        tg.append(n_gen / (t2 - t1))
    isa = llm.backend.isa
    llm.close()
    return {"pp_tps": float(np.median(pp)), "tg_tps": float(np.median(tg)), "pp_samples": pp, "tg_samples": tg,
            "isa": isa}


def llama_cpu_seconds(path: Path, reps: int, n_prompt: int, n_gen: int) -> tuple[float, str]:
    """CPU seconds of one llama-bench run of the test (-p n_prompt -n n_gen), one thread."""
    def run(r: int) -> tuple[float, str]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc, variant = peer.run("llama-bench", ["-m", str(path), "-t", "1", "-p", str(n_prompt), "-n", str(n_gen),
                                                 "-r", str(r), "-o", "json"])
        if proc.returncode != 0:
            raise RuntimeError(f"llama-bench failed ({proc.returncode}): {proc.stderr[-500:]}")
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, variant
    one, variant = run(1)
    many, _ = run(1 + reps)
    return (many - one) / reps, variant


def llama_cpu_speeds(path: Path, reps: int, n_prompt: int, n_gen: int) -> dict:
    pp_s, variant = llama_cpu_seconds(path, reps, n_prompt, 0)
    tg_s, _ = llama_cpu_seconds(path, reps, 0, n_gen)
    return {"pp_tps": n_prompt / pp_s, "tg_tps": n_gen / tg_s, "variant": variant}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=TYPES, choices=TYPES)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--cpu-time", action="store_true", help="one thread each, tokens per CPU second")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "lowbit.json")
    args = ap.parse_args()
    if args.cpu_time:
        args.threads = 1
    if not peer.available():
        sys.exit(f"llama.cpp not found at {peer.llama_cpp_dir()} (set LLAMA_CPP_DIR)")
    results = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_bench.cpu_name(), "threads": args.threads,
               "measure": "tokens per CPU second" if args.cpu_time else "tokens per wall second",
               "reps": args.reps, "n_prompt": args.n_prompt, "n_gen": args.n_gen,
               "load_before": cpu_bench.machine_load(), "types": {}}
    print(f"{results['cpu']}, {args.threads} thread(s), {results['measure']}; "
          f"load average {results['load_before']['loadavg'][0]:.2f}")
    print(f"{'type':8} {'bpw':>5} {'pp' + str(args.n_prompt):>17} {'ratio':>6} {'tg' + str(args.n_gen):>15} {'ratio':>6}"
          "   (ember, llama.cpp tok/s)")
    for name in args.types:
        qtype = GGMLType[name]
        path = ensure(qtype)
        if args.cpu_time:
            e = ember_cpu_speeds(path, args.reps, args.n_prompt, args.n_gen)
            p = llama_cpu_speeds(path, args.reps, args.n_prompt, args.n_gen)
        else:
            e, p = cpu_bench.speeds(path, args.threads, args.reps, args.n_prompt, args.n_gen)
        bpw = 8 * layout(qtype).type_size / layout(qtype).block_size
        results["types"][name] = {"path": str(path), "bits_per_weight": bpw, "ember": e, "llama_cpp": p,
                                  "pp_ratio": e["pp_tps"] / p["pp_tps"], "tg_ratio": e["tg_tps"] / p["tg_tps"]}
        print(f"{name:8} {bpw:5.2f} {e['pp_tps']:8.1f} {p['pp_tps']:8.1f} {e['pp_tps'] / p['pp_tps']:6.2f}"
              f" {e['tg_tps']:7.1f} {p['tg_tps']:7.1f} {e['tg_tps'] / p['tg_tps']:6.2f}   ({e['isa']}, {p['variant']})",
              flush=True)
    results["load_after"] = cpu_bench.machine_load()
    print(f"load average {results['load_after']['loadavg'][0]:.2f} at the end"
          + (f"; busy: {results['load_after']['busy']}" if results["load_after"]["busy"] else ""))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
