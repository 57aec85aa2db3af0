"""CPU speed: ember beside llama.cpp (llama-bench, llama-completion) in the same run.

For each model: load time, prompt processing (pp512: 512 tokens in one batch from an
empty context) and generation (tg128: 128 tokens one at a time from an empty context),
as llama-bench defines them, plus cold start (process start to one generated token), the
peak resident memory of a generating process against its budget (file + KV cache + 64 MB),
speed at 1 thread beside --threads (scaling; ember's runs alternate between the two), and a per-kernel profile of ember's decode and
prompt steps (native time per op, and the share of a decode step spent outside the kernels).
Medians of --reps runs, ember's and llama.cpp's in turn; ratios are ember / llama.cpp (above 1:
ember is faster, or for times, slower). Writes JSON to bench/results/cpu.json.

    python bench/cpu.py [--models smollm2 gemma3-270m] [--threads 2] [--reps 5] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer  # noqa: E402

from ember import hub  # noqa: E402
from ember.backends.cpu import Profile  # noqa: E402
from ember.engine import LLM  # noqa: E402
from ember.sampler import SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def speeds(model: str, path: Path, threads: int, reps: int, n_prompt: int, n_gen: int) -> tuple[dict, dict]:
    """ember's and llama.cpp's speeds, one run of each in turn, `reps` times: load on the machine from other
    processes then reaches both alike (runs of one side minutes apart moved ratios by 10-20% here)."""
    e = {"load_s": statistics.median(ember_loads(model, threads, reps, n_prompt, n_gen))}
    llm = LLM(model, device="cpu", threads=threads, ctx=max(n_prompt, n_gen) + 16, batch=n_prompt)
    rng = np.random.default_rng(0)
    ignore = lambda logits, positions: None  # noqa: E731 - the logits are not needed, only computed
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    llm.evaluate(rng.integers(0, llm.model.n_vocab, n_prompt).tolist(), ignore, logits_from=n_prompt - 1)  # warm-up
    e_pp, e_tg, p_pp, p_tg, build = [], [], [], [], "?"
    for _ in range(reps):
        prompt, first = rng.integers(0, llm.model.n_vocab, n_prompt).tolist(), int(rng.integers(0, 1000))
        e_pp.append(n_prompt / _timed(lambda p=prompt: llm.evaluate(p, ignore, logits_from=n_prompt - 1)))
        # n_gen single-token steps from a one-token context, each sampled greedily (what a user gets)
        e_tg.append(n_gen / _timed(lambda t=first: llm.generate([t], n_gen, greedy)))
        peer_run = llama_bench(path, threads, 1, n_prompt, n_gen)
        p_pp, p_tg, build = p_pp + peer_run["pp_samples"], p_tg + peer_run["tg_samples"], peer_run["build"]
    e.update(pp_tps=statistics.median(e_pp), tg_tps=statistics.median(e_tg), pp_samples=e_pp, tg_samples=e_tg,
             isa=getattr(llm.backend, "isa", "?"))
    llm.close()
    p = {"build": build, "pp_tps": statistics.median(p_pp), "tg_tps": statistics.median(p_tg),
         "pp_samples": p_pp, "tg_samples": p_tg}
    return e, p


def ember_loads(model: str, threads: int, reps: int, n_prompt: int, n_gen: int) -> list[float]:
    """Seconds to construct an LLM (the file in the page cache), `reps` times."""
    loads = []
    for _ in range(reps):
        t0 = time.perf_counter()
        llm = LLM(model, device="cpu", threads=threads, ctx=max(n_prompt, n_gen) + 16, batch=n_prompt)
        loads.append(time.perf_counter() - t0)
        llm.close()
    return loads


def ember_scaling(model: str, threads: int, reps: int, n_prompt: int, n_gen: int) -> dict:
    """pp and tg at 1 thread and at `threads`, the runs alternating so that both see the same load on the
    machine (other processes move runs made minutes apart by more than the difference measured)."""
    counts = sorted({1, threads})
    llms = {t: LLM(model, device="cpu", threads=t, ctx=max(n_prompt, n_gen) + 16, batch=n_prompt) for t in counts}
    rng = np.random.default_rng(2)
    ignore = lambda logits, positions: None  # noqa: E731
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    pp: dict = {t: [] for t in counts}
    tg: dict = {t: [] for t in counts}
    for llm in llms.values():  # warm-up: first touch of the weights
        llm.evaluate(rng.integers(0, llm.model.n_vocab, n_prompt).tolist(), ignore, logits_from=n_prompt - 1)
    for _ in range(reps):
        for t, llm in llms.items():
            prompt, first = rng.integers(0, llm.model.n_vocab, n_prompt).tolist(), int(rng.integers(0, 1000))
            pp[t].append(n_prompt / _timed(lambda m=llm, p=prompt: m.evaluate(p, ignore, logits_from=n_prompt - 1)))
            tg[t].append(n_gen / _timed(lambda m=llm, f=first: m.generate([f], n_gen, greedy)))
    for llm in llms.values():
        llm.close()
    return {str(t): {"pp_tps": statistics.median(pp[t]), "tg_tps": statistics.median(tg[t]),
                     "pp_samples": pp[t], "tg_samples": tg[t]} for t in counts}


def profile(model: str, threads: int, n_prompt: int, n_gen: int) -> dict:
    """Native time per op kind for one pp and one tg run, and the share of the unprofiled wall time
    (median of 3) spent outside them."""
    llm = LLM(model, device="cpu", threads=threads, ctx=max(n_prompt, n_gen) + 16, batch=n_prompt)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    ignore = lambda logits, positions: None  # noqa: E731
    prompt = np.random.default_rng(1).integers(0, llm.model.n_vocab, n_prompt).tolist()
    llm.evaluate(prompt, ignore, logits_from=n_prompt - 1)
    llm.generate([1], 8, greedy)
    out = {}
    for name, run in (("pp", lambda: llm.evaluate(prompt, ignore, logits_from=n_prompt - 1)),
                      ("tg", lambda: llm.generate([1], n_gen, greedy))):
        llm.backend.profile = prof = Profile()
        wall = _timed(run)
        llm.backend.profile = None
        # decode steps are recorded: their share outside the kernels comes from timing the replays alone
        outside = replay_share(llm, run) if name == "tg" else 1 - prof.total_s / wall
        kinds = prof.by_kind()
        out[name] = {"wall_s": wall, "native_s": prof.total_s, "outside_share": outside,
                     "by_kind_s": kinds,
                     "top_ops_s": dict(sorted(((k, v / 1e9) for k, v in prof.ns.items()), key=lambda kv: -kv[1])[:8])}
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


def peak_rss(model: str, path: Path, threads: int, n_gen: int, ctx: int) -> dict:
    """Resident memory of a process that has generated n_gen tokens (and its peak, load included),
    against file + KV + 64 MB."""
    code = ("import resource, sys; from ember.engine import LLM; from ember.sampler import SamplingParams; "
            f"llm = LLM({model!r}, device='cpu', threads={threads}, ctx={ctx}); "
            f"llm.generate(llm.tokenize('Once upon a time'), {n_gen}, SamplingParams(temperature=0, ignore_eos=True)); "
            "rss = [l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]; "
            "print(llm.engine.cache.nbytes, rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    kv_bytes, rss_kib, peak_kib = (int(v) for v in proc.stdout.split()[-3:])
    file_bytes = os.path.getsize(path)
    budget = file_bytes + kv_bytes + (64 << 20)
    return {"rss_bytes": rss_kib * 1024, "peak_rss_bytes": peak_kib * 1024, "file_bytes": file_bytes,
            "kv_bytes": kv_bytes, "budget_bytes": budget, "within_budget": rss_kib * 1024 <= budget}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def llama_bench(path: Path, threads: int, reps: int, n_prompt: int, n_gen: int) -> dict:
    proc, build = peer.run("llama-bench", ["-m", str(path), "-t", str(threads), "-p", str(n_prompt),
                                           "-n", str(n_gen), "-r", str(reps), "-o", "json"])
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}): {proc.stderr[-500:]}")
    out = {"build": build}
    for test in json.loads(proc.stdout):
        key = "pp_tps" if test["n_gen"] == 0 else "tg_tps"
        out[key] = statistics.median(test["samples_ts"])
        out[key.replace("tps", "samples")] = test["samples_ts"]
    return out


def cold_starts(model: str, path: Path, threads: int, reps: int) -> dict:
    """Seconds from process start to exit after generating one token from a short prompt, after one
    untimed run of each (the file in the page cache, as for every other figure here)."""
    prompt = "The capital of France is"
    ember_cmd = [sys.executable, "-m", "ember", "run", model, "-p", prompt, "-n", "1", "--temp", "0",
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


def report_details(r: dict, threads: int, e: dict, p: dict) -> None:
    m = r["memory"]
    print(f"  RSS while generating: {m['rss_bytes'] / 2**20:.0f} MiB (peak, load included: "
          f"{m['peak_rss_bytes'] / 2**20:.0f}); budget file {m['file_bytes'] / 2**20:.0f}"
          f" + KV {m['kv_bytes'] / 2**20:.0f} + 64 = {m['budget_bytes'] / 2**20:.0f} MiB "
          f"({'within' if m['within_budget'] else 'OVER'})")
    e1, en = r["scaling"]["ember"]["1"], r["scaling"]["ember"][str(threads)]
    p1 = r["scaling"]["llama_cpp_1"]
    for key, label in (("pp_tps", "pp"), ("tg_tps", "tg")):
        print(f"  scaling {label}: ember 1 thread {e1[key]:.1f}, {threads} threads {en[key]:.1f} "
              f"({en[key] / e1[key]:.2f}x, alternating runs); llama.cpp {p1[key]:.1f} -> {p[key]:.1f} "
              f"({p[key] / p1[key]:.2f}x)")
    for name, prof in r["profile"].items():
        total = prof["native_s"]
        parts = ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in list(prof["by_kind_s"].items())[:7])
        print(f"  profile {name}: {prof['wall_s'] * 1000:.0f} ms wall, outside kernels {100 * prof['outside_share']:.1f}%;"
              f" {parts}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--out", type=Path, default=RESULTS / "cpu.json")
    ap.add_argument("--quick", action="store_true", help="speed and cold start only (no memory, scaling, profile)")
    args = ap.parse_args()
    if not peer.available():
        sys.exit(f"llama.cpp not found at {peer.llama_cpp_dir()} (set LLAMA_CPP_DIR)")
    results = {"threads": args.threads, "reps": args.reps, "models": {}}
    for model in args.models:
        path = hub.resolve(model)
        e, p = speeds(model, path, args.threads, args.reps, args.n_prompt, args.n_gen)
        c = cold_starts(model, path, args.threads, args.reps)
        results["models"][model] = r = {"ember": e, "llama_cpp": p, "cold_start": c}
        if not args.quick:
            r["memory"] = peak_rss(model, path, args.threads, args.n_gen, args.n_prompt + args.n_gen)
            one = max(1, min(3, args.reps))
            r["scaling"] = {"ember": ember_scaling(model, args.threads, args.reps, args.n_prompt, args.n_gen),
                            "llama_cpp_1": llama_bench(path, 1, one, args.n_prompt, args.n_gen)}
            r["profile"] = profile(model, args.threads, args.n_prompt, args.n_gen)
        print(f"\n{model} ({args.threads} threads, median of {args.reps}; ember ISA {e['isa']}, "
              f"llama.cpp {p['build']} build)")
        print(f"  {'':8} {'ember':>10} {'llama.cpp':>10} {'ratio':>7}")
        for key, label in (("pp_tps", f"pp{args.n_prompt}"), ("tg_tps", f"tg{args.n_gen}")):
            print(f"  {label:8} {e[key]:10.1f} {p[key]:10.1f} {e[key] / p[key]:7.2f}  tokens/s")
        print(f"  {'cold':8} {c['ember_s']:10.2f} {c['llama_cpp_s']:10.2f} {c['ember_s'] / c['llama_cpp_s']:7.2f}  s to first token")
        print(f"  ember load (in process): {e['load_s'] * 1000:.0f} ms")
        if not args.quick:
            report_details(r, args.threads, e, p)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
