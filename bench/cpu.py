"""CPU speed: ember beside llama.cpp (llama-bench, llama-completion) in the same run, up a ladder of
model sizes, against the machine's memory read roofline.

The ladder (bench/ladder.py): the two real models, then llama-shaped files in llama.cpp's Q4_K_M type
mix at the sizes of Llama-3.2-1B, Qwen3-4B and Llama-3.1-8B (written once outside the repository).
For each model and each thread count: prompt processing (pp512: 512 tokens in one batch from an empty
context) and generation (tgN: N tokens one at a time, greedy, as llama-bench defines them; fewer for
the big files), ember's and llama.cpp's runs alternating so that both see the same machine. The
roofline is measured here: a multi-threaded read of a 1 GiB buffer at each thread count (the best of
5 passes), at the start of the run and again just before and just after each model's runs, the
model's roofline being the median of those three reads (this shared machine's read bandwidth moves
by ~20% within an hour); a decode step reads every layer matrix and the output head once, so
bandwidth / those bytes is the most tokens per second any engine can generate, and tg is reported
as a fraction of it. Then cold start
(process start to one generated token), and unless --quick the peak resident memory and a per-kernel
profile of ember's decode and prompt steps (native time per op, each decode product's bytes/s, and
the share of a decode step spent outside the kernels). Medians of --reps runs; ratios are
ember / llama.cpp (above 1: ember is faster). Writes JSON to bench/results/cpu.json.

llama.cpp's thread pool spins while it waits: with another busy process on the machine its figures
collapse. Run this on an otherwise idle machine; the load average before and after is printed and kept.

    python bench/cpu.py [--models smollm2 gemma3-270m llama-1b qwen3-4b llama-8b] [--threads 1 2]
                        [--reps 5] [--quick]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ladder  # noqa: E402
import peer  # noqa: E402

from ember.backends.cpu import Profile, read_bandwidth  # noqa: E402
from ember.engine import LLM  # noqa: E402
from ember.gguf_loader import GGUFFile  # noqa: E402
from ember.sampler import SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# generated tokens per rung: the big files take fewer (each token reads gigabytes)
N_GEN = {"smollm2": 128, "gemma3-270m": 128, "llama-1b": 64, "qwen3-4b": 32, "llama-8b": 16,
         "olmo2-1b": 64, "granite-2b": 32, "gemma2-2b": 32, "ministral3-3b": 32, "smollm3-3b": 32, "phi4-mini": 32,
         "qwen3-30b-a3b-8l": 64, "gpt-oss-20b-6l": 64, "olmoe-1b-7b": 64, "qwen3-30b-a3b": 32}
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def ignore(logits, positions):  # the logits are computed, not needed
    return None


def step_bytes(path: Path) -> int:
    """Bytes of weights a decode step reads: every layer matrix and the output head (the tied
    embedding when there is no output.weight); the embedding lookup reads one row; of stacked
    experts (3-D), the share of the experts one token takes."""
    with GGUFFile(path) as f:
        tensors = {t.name: t for t in (f.tensors.values() if isinstance(f.tensors, dict) else f.tensors)}
        head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
        arch = f.metadata.get("general.architecture")
        used = f.metadata.get(f"{arch}.expert_used_count", 0) / max(f.metadata.get(f"{arch}.expert_count", 1), 1)
        return int(sum(len(t.data) * (used if len(t.shape) == 3 else 1) for name, t in tensors.items()
                       if (name.startswith("blk.") and len(t.shape) in (2, 3)) or name == head))


def speeds(path: Path, threads: int, reps: int, n_prompt: int, n_gen: int, apart: bool = False) -> tuple[dict, dict]:
    """ember's and llama.cpp's pp and tg at `threads`, one run of each in turn, `reps` times. apart:
    ember's engine closed before each llama.cpp run and made again after it (a model that does not
    fit in memory twice: llama.cpp's CPU build copies the weights it repacks into memory of its own)."""
    rng = np.random.default_rng(threads)

    def ready() -> LLM:
        llm = LLM(str(path), device="cpu", threads=threads, ctx=n_prompt + n_gen + 16, batch=n_prompt)
        vocab = min(llm.model.n_vocab, 32000)
        llm.evaluate(rng.integers(0, vocab, n_prompt).tolist(), ignore, logits_from=n_prompt - 1)  # warm-up
        llm.generate([1], 4, GREEDY)
        llm.backend.settled()  # time the weights where they stay, not during their move onto huge pages
        return llm

    llm = None
    e_pp, e_tg, p_pp, p_tg, variant = [], [], [], [], "?"
    for _ in range(reps):
        if llm is None and apart:
            in_page_cache(path)  # llama.cpp's copy pushed the file out of it
        llm = llm or ready()
        vocab, isa = min(llm.model.n_vocab, 32000), llm.backend.isa
        prompt, first = rng.integers(0, vocab, n_prompt).tolist(), int(rng.integers(0, vocab))
        e_pp.append(n_prompt / _timed(lambda p=prompt: llm.evaluate(p, ignore, logits_from=n_prompt - 1)))
        # n_gen single-token steps from a one-token context, each sampled greedily (what a user gets)
        e_tg.append(n_gen / _timed(lambda t=first: llm.generate([t], n_gen, GREEDY)))
        if apart:  # its memory back before llama.cpp loads (the engine's objects hold cycles: collected)
            llm.close()
            llm = None
            gc.collect()
        peer_run = llama_bench(path, threads, 1, n_prompt, n_gen)
        p_pp, p_tg, variant = p_pp + peer_run["pp_samples"], p_tg + peer_run["tg_samples"], peer_run["variant"]
    if llm is not None:
        llm.close()
    e = {"pp_tps": statistics.median(e_pp), "tg_tps": statistics.median(e_tg), "pp_samples": e_pp,
         "tg_samples": e_tg, "isa": isa}
    p = {"pp_tps": statistics.median(p_pp), "tg_tps": statistics.median(p_tg), "pp_samples": p_pp,
         "tg_samples": p_tg, "variant": variant}
    return e, p


def in_page_cache(path: Path) -> None:
    """The file read through once, so that its pages are in the page cache (as llama.cpp's weights are
    in its memory when it times a run): expert products then read no page from disk."""
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass


def llama_bench(path: Path, threads: int, reps: int, n_prompt: int, n_gen: int) -> dict:
    proc, variant = peer.run("llama-bench", ["-m", str(path), "-t", str(threads), "-p", str(n_prompt),
                                             "-n", str(n_gen), "-r", str(reps), "-o", "json"])
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}): {proc.stderr[-500:]}")
    out = {"variant": variant}
    for test in json.loads(proc.stdout):
        key = "pp_tps" if test["n_gen"] == 0 else "tg_tps"
        out[key] = statistics.median(test["samples_ts"])
        out[key.replace("tps", "samples")] = test["samples_ts"]
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def profile(path: Path, threads: int, n_prompt: int, n_gen: int) -> dict:
    """Native time per op kind for one pp and one tg run, each decode product's weight bytes per
    second, and the share of the wall time (tg: of the replays) spent outside the kernels."""
    llm = LLM(str(path), device="cpu", threads=threads, ctx=n_prompt + n_gen + 16, batch=n_prompt)
    prompt = np.random.default_rng(1).integers(0, min(llm.model.n_vocab, 32000), n_prompt).tolist()
    llm.evaluate(prompt, ignore, logits_from=n_prompt - 1)
    llm.generate([1], 8, GREEDY)
    out = {}
    for name, run in (("pp", lambda: llm.evaluate(prompt, ignore, logits_from=n_prompt - 1)),
                      ("tg", lambda: llm.generate([1], n_gen, GREEDY))):
        llm.backend.profile = prof = Profile()
        wall = _timed(run)
        llm.backend.profile = None
        # decode steps are recorded: their share outside the kernels comes from timing the replays alone
        outside = replay_share(llm, run) if name == "tg" else 1 - prof.total_s / wall
        out[name] = {"wall_s": wall, "native_s": prof.total_s, "outside_share": outside, "by_kind_s": prof.by_kind(),
                     "top_ops_s": dict(sorted(((k, v / 1e9) for k, v in prof.ns.items()), key=lambda kv: -kv[1])[:8])}
        if name == "tg":
            out[name]["weight_gbs"] = {k: v / 1e9 for k, v in sorted(prof.rates().items(), key=lambda kv: -prof.ns[kv[0]])}
    llm.close()
    return out


def replay_share(llm, run) -> float:
    """Share of a run's wall time spent outside the native replays of recorded steps."""
    backend, spent = llm.backend, [0.0]
    replay = backend.replay

    def timed_replay(rec):
        t0 = time.perf_counter()
        replay(rec)
        spent[0] += time.perf_counter() - t0

    backend.replay = timed_replay  # an instance attribute over the method, removed below
    try:
        wall = _timed(run)
    finally:
        del backend.replay
    return 1 - spent[0] / wall


def peak_rss(path: Path, threads: int, n_gen: int, ctx: int) -> dict:
    """Resident memory of a process that has generated n_gen tokens (and its peak, load included),
    against file + KV + 64 MB."""
    # VmHWM, not ru_maxrss: the latter keeps the peak of the forking parent (this process) across exec
    code = ("from ember.engine import LLM; from ember.sampler import SamplingParams; "
            f"llm = LLM({str(path)!r}, device='cpu', threads={threads}, ctx={ctx}); "
            f"llm.generate([1, 2, 3], {n_gen}, SamplingParams(temperature=0, ignore_eos=True)); "
            "kib = {l.split(':')[0]: l.split()[1] for l in open('/proc/self/status') if l.startswith('Vm')}; "
            "print(llm.engine.cache.nbytes, kib['VmRSS'], kib['VmHWM'])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    kv_bytes, rss_kib, peak_kib = (int(v) for v in proc.stdout.split()[-3:])
    file_bytes = os.path.getsize(path)
    budget = file_bytes + kv_bytes + (64 << 20)
    return {"rss_bytes": rss_kib * 1024, "peak_rss_bytes": peak_kib * 1024, "file_bytes": file_bytes,
            "kv_bytes": kv_bytes, "budget_bytes": budget, "within_budget": rss_kib * 1024 <= budget}


def cold_starts(path: Path, threads: int, reps: int) -> dict:
    """Seconds from process start to exit after generating one token from a short prompt, after one
    untimed run of each (the file in the page cache, as for every other figure here)."""
    prompt = "The capital of France is"
    ember_cmd = [sys.executable, "-m", "ember", "run", str(path), "-p", prompt, "-n", "1", "--temp", "0",
                 "-t", str(threads)]
    env = installed_env()

    def run_ember():
        subprocess.run(ember_cmd, capture_output=True, check=True, env=env)

    def run_peer():
        peer.run("llama-completion", ["-m", str(path), "-p", prompt, "-n", "1", "-t", str(threads), "-no-cnv",
                                      "--temp", "0"])

    run_ember(), run_peer()
    ember_t, peer_t = [], []
    for _ in range(reps):
        ember_t.append(_timed(run_ember))
        peer_t.append(_timed(run_peer))
    return {"ember_s": statistics.median(ember_t), "llama_cpp_s": statistics.median(peer_t)}


def installed_env() -> dict:
    """The environment with Python's bytecode cache on, as a pip-installed ember runs (pip compiles it at
    install time); a development shell may set PYTHONDONTWRITEBYTECODE, which makes every start compile
    ember's sources again (30-50 ms here). The cache goes to bench/results/pycache, not the source tree."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.setdefault("PYTHONPYCACHEPREFIX", str(RESULTS / "pycache"))
    return env


def machine_load() -> dict:
    """Load average and the busiest other processes: figures taken while others run are not comparable."""
    out = subprocess.run(["ps", "-eo", "pcpu,args", "--sort=-pcpu"], capture_output=True, text=True).stdout
    busy = [line.strip()[:120] for line in out.splitlines()[1:6] if float(line.split()[0]) >= 5.0]
    return {"loadavg": list(os.getloadavg()), "busy": busy}


def bench_model(name: str, args) -> dict:
    path = ladder.ensure(name)
    n_gen = args.n_gen or N_GEN.get(name, 128)
    nbytes = step_bytes(path)
    r = {"path": str(path), "step_bytes": nbytes, "n_gen": n_gen, "threads": {}}
    for t in args.threads:
        before = read_bandwidth(t)
        e, p = speeds(path, t, args.reps, args.n_prompt, n_gen, args.apart)
        reads = [args.bandwidth[t], before, read_bandwidth(t)]
        roof = statistics.median(reads) / nbytes
        r["threads"][str(t)] = {"ember": e, "llama_cpp": p, "roofline_tps": roof,
                                "read_gbs": [round(b / 1e9, 2) for b in reads]}
    r["cold_start"] = cold_starts(path, max(args.threads), args.reps)
    if not args.quick:
        r["memory"] = peak_rss(path, max(args.threads), n_gen, args.n_prompt + n_gen)
        r["profile"] = profile(path, max(args.threads), args.n_prompt, n_gen)
    report(name, r, args)
    return r


def report(name: str, r: dict, args) -> None:
    first = next(iter(r["threads"].values()))
    print(f"\n{name}: {r['step_bytes'] / 1e6:.0f} MB of weights per decode step "
          f"(ember ISA {first['ember']['isa']}, llama.cpp {first['llama_cpp']['variant']} variant)")
    print(f"  {'':12} {'ember':>9} {'llama.cpp':>9} {'ratio':>6}   tg / roofline: ember, llama.cpp")
    for t, m in r["threads"].items():
        e, p, roof = m["ember"], m["llama_cpp"], m["roofline_tps"]
        print(f"  pp{args.n_prompt:<4} {t}t     {e['pp_tps']:9.1f} {p['pp_tps']:9.1f} {e['pp_tps'] / p['pp_tps']:6.2f}")
        print(f"  tg{r['n_gen']:<4} {t}t     {e['tg_tps']:9.1f} {p['tg_tps']:9.1f} {e['tg_tps'] / p['tg_tps']:6.2f}"
              f"   {100 * e['tg_tps'] / roof:4.0f}%, {100 * p['tg_tps'] / roof:4.0f}% of {roof:.1f} tok/s "
              f"(reads {' / '.join(f'{b:.1f}' for b in m['read_gbs'])} GB/s)")
    c = r["cold_start"]
    print(f"  cold start   {c['ember_s']:9.2f} {c['llama_cpp_s']:9.2f} {c['ember_s'] / c['llama_cpp_s']:6.2f}  s to first token")
    if "memory" in r:
        m = r["memory"]
        print(f"  RSS while generating: {m['rss_bytes'] / 2**20:.0f} MiB (peak {m['peak_rss_bytes'] / 2**20:.0f}); "
              f"budget {m['budget_bytes'] / 2**20:.0f} MiB ({'within' if m['within_budget'] else 'OVER'})")
    for phase, prof in r.get("profile", {}).items():
        parts = ", ".join(f"{k} {100 * v / prof['native_s']:.1f}%" for k, v in list(prof["by_kind_s"].items())[:7])
        print(f"  profile {phase}: {prof['wall_s'] * 1000:.0f} ms wall, outside kernels "
              f"{100 * prof['outside_share']:.1f}%; {parts}")
        for label, gbs in list(prof.get("weight_gbs", {}).items())[:6]:
            print(f"    {label}: {gbs:.1f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(ladder.LADDER), choices=[*ladder.LADDER, *ladder.FAMILIES],
                    help="the ladder by default; the decoder families at real shapes on request")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, help="generated tokens for every model (default: by size)")
    ap.add_argument("--out", type=Path, default=RESULTS / "cpu.json")
    ap.add_argument("--quick", action="store_true", help="speeds and cold start only (no memory, profile)")
    ap.add_argument("--apart", action="store_true",
                    help="ember's engine closed while llama.cpp runs (models that do not fit in memory twice)")
    args = ap.parse_args()
    if not peer.available():
        sys.exit(f"llama.cpp not found at {peer.llama_cpp_dir()} (set LLAMA_CPP_DIR)")
    results = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "reps": args.reps,
               "load_before": machine_load(), "models": {}}
    args.bandwidth = {t: read_bandwidth(t) for t in args.threads}
    results["read_bandwidth_gbs"] = {str(t): b / 1e9 for t, b in args.bandwidth.items()}
    print(f"{results['cpu']}; read roofline " + ", ".join(f"{t} thread{'s' * (t > 1)} {b / 1e9:.1f} GB/s"
                                                       for t, b in args.bandwidth.items())
          + f"; load average {results['load_before']['loadavg'][0]:.2f}")
    for name in args.models:  # written after each model: a run cut short keeps what it measured
        results["models"][name] = bench_model(name, args)
        results["load_after"] = machine_load()
        write(args.out, results)
    print(f"\nload average {results['load_after']['loadavg'][0]:.2f} at the end"
          + (f"; busy: {results['load_after']['busy']}" if results["load_after"]["busy"] else ""))
    print(f"wrote {args.out}")


def write(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f", {os.cpu_count()} cores"
    except OSError:
        pass
    return "?"


if __name__ == "__main__":
    main()
