"""Where a speculative run's time goes, in process: each step's rows and compute time, the host's
time around it, and a step's cost against its rows for one sequence.

    python bench/spec_steps.py [--model smollm2] [--device cpu] [--threads 2] [--workloads edit,free,agent] [--reps 2]
                               [--sweep 1,2,3,4,5,6,8,12,17] [--profile] [--trace]

For each workload prompt (bench/spec.py's), ember without and with `--spec-type cache,lookup`:
generation tokens/s, steps, the steps' compute time (the runner's run, as the device is waited
for on a CPU) and the rest of the engine's step (planning, drafting, choosing, bookkeeping) per
generated token; `agent` (8 sessions at once, 8 slots): the whole run's time split by kind of
step (with prompt rows; decode only, by decoding sequences, with or without drafts). --sweep: after
a prompt, the median time of a step of one sequence with that many rows (its pending token and
drafted ones that are rejected), against a plain decode step; it runs before the workloads, so their
steps of those shapes replay recordings (a long-running server's state) instead of recording as they
come (each rep prints how many steps recorded their shape, and their time).
--profile: cProfile of the engine thread's host work in the speculative run (top functions).
--trace: each edit/free request's drafts in order, `[found>verified]` (tokens the sources found, tokens
the length rule let into the step; `[0>0]` steps left out) and then source, drafted:kept (`l` lookup,
`i` the shared index, `t` the tree): where drafts stay short although they are kept, and why.
No peer: what it measures is ember's own split, which the HTTP benchmark (bench/spec.py) has not.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from spec import Prompts  # noqa: E402

from ember import hub  # noqa: E402
from ember.engine.llm import LLM  # noqa: E402
from ember.sampler import SamplingParams  # noqa: E402

N_PREDICT = {"edit": 384, "free": 128}


class StepClock:
    """Wraps the engine's step and the runner's run: per step, rows and compute seconds; the
    engine step's whole time (host + compute)."""

    def __init__(self, llm: LLM):
        self.engine, self.runner = llm.engine, llm.engine.runner
        self.steps: list[tuple[int, float, float]] = []  # (rows, compute s, whole step s)
        self.shapes: list[tuple[int, int, int]] = []  # per step: (decoding sequences, drafted rows, prompt rows)
        self.recorded: list[bool] = []  # per step: whether its shape was recorded as it ran (a first sight)
        self._compute = 0.0
        run, step = self.runner.run, self.engine.step

        def timed_run(plan, *a, **kw):
            t0 = time.perf_counter()
            out = run(plan, *a, **kw)
            self._compute += time.perf_counter() - t0
            self._rows = sum(c.n for c in plan.chunks)
            self._shape = step_shape(plan)
            return out

        def timed_step():
            self._compute, self._rows = 0.0, 0
            t0 = time.perf_counter()
            step()
            if self._rows:
                self.steps.append((self._rows, self._compute, time.perf_counter() - t0))
                self.shapes.append(self._shape)
                self.recorded.append(self.runner.recorded)

        self.runner.run, self.engine.step = timed_run, timed_step

    def reset(self) -> None:
        self.steps, self.shapes, self.recorded = [], [], []


def step_shape(plan) -> tuple[int, int, int]:
    """A step's decoding sequences, drafted rows and prompt rows."""
    decodes = [c for c in plan.chunks if c.n - len(c.draft) == 1]
    drafted = sum(len(c.draft) for c in plan.chunks)
    return len(decodes), drafted, sum(c.n for c in plan.chunks) - len(decodes) - drafted


def agent_split(llm: LLM, prompts: Prompts, rep: int, clock: StepClock, sessions: int = 8, turns: int = 3,
                n_predict: int = 64) -> None:
    """bench/spec.py's agent workload in process: the run's wall time and its steps' time by kind
    (with prompt rows; decode only, by decoding sequences, with and without drafts)."""
    from concurrent.futures import ThreadPoolExecutor
    params = SamplingParams(temperature=0.0)
    per_session = prompts.agent(rep, sessions, turns)
    clock.reset()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(sessions) as pool:
        outs = [o for os_ in pool.map(lambda ps: [llm.generate(ids, max_tokens=n_predict, sampling=params)
                                                  for ids in ps], per_session) for o in os_]
    wall = time.perf_counter() - t0
    tokens = sum(o.timings.generated_tokens for o in outs)
    kinds: dict[str, list[float]] = {}
    for (rows, _, whole), (dec, drafted, prompt) in zip(clock.steps, clock.shapes):
        kind = ("prompt" + (" +decode" if dec else "")) if prompt else f"decode x{dec}" + (" +draft" if drafted else "")
        k = kinds.setdefault(kind, [0, 0.0, 0, 0, 0])
        k[0] += 1
        k[1] += whole
        k[2] += rows
        k[3] += drafted
        k[4] += dec
    stepped = sum(s[2] for s in clock.steps)
    print(f"agent rep {rep}: {tokens} tokens in {wall:.2f} s ({tokens / wall:.1f} tok/s), steps {len(clock.steps)} "
          f"taking {stepped:.2f} s, outside steps {wall - stepped:.2f} s; request tps median "
          f"{statistics.median(o.timings.generation_tps for o in outs):.1f}")
    for kind, (n, secs, rows, drafted, dec) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        print(f"  {kind:20s} {n:5d} steps {secs:6.2f} s ({1e3 * secs / n:5.1f} ms a step) rows {rows:6d} "
              f"drafted {drafted:5d} decode tokens {dec:5d}")


class DraftTrace:
    """Wraps the length rule and the drafts' verification of the speculative module (one sequence
    at a time: the length rule's choice is shown for single-sequence steps)."""

    def __init__(self):
        from ember.engine import speculate
        self.items: list[str] = []
        lengths, adapt = speculate.draft_lengths, speculate.DraftState.adapt

        def traced_lengths(rates, found, base, costs):
            out = lengths(rates, found, base, costs)
            if len(found) == 1 and found[0]:
                self.items.append(f"[{found[0]}>{out[0]}]")
            return out

        def traced_adapt(st, drafted, accepted):
            self.items.append(f"{st.source[:1]}{drafted}:{accepted}")
            return adapt(st, drafted, accepted)

        speculate.draft_lengths, speculate.DraftState.adapt = traced_lengths, traced_adapt

    def take(self) -> str:
        out, self.items = " ".join(self.items), []
        return out


def generate(llm: LLM, ids: list[int], n: int) -> tuple[float, int]:
    """Generation tokens/s (first token to last) and tokens."""
    out = llm.generate(ids, max_tokens=n, sampling=SamplingParams(temperature=0.0))
    return out.timings.generation_tps, out.timings.generated_tokens


def sweep(llm: LLM, ids: list[int], rows: list[int], reps: int = 15) -> dict[int, float]:
    """Median ms of a one-sequence step of each row count, timed by drafting a token that is
    rejected (the step's cost without its gain), one token generated per step."""
    from ember.engine.sequence import Status
    spec, engine = llm.engine.spec, llm.engine
    propose, run = spec.propose, engine.runner.run
    out = {}
    for n in rows:
        times: list[tuple[int, float]] = []

        def wrong(running, n=n):
            for seq in running:
                ok = seq.status is Status.RUNNING and seq.n_pending == 1 and seq.n_generated > 0
                seq.draft = [seq.tokens[-1] ^ 1] * (n - 1) if ok else []  # not what the model picks
                seq.owner.spec.source = "lookup"
            return n > 1

        def timed(plan, *a, **kw):
            t0 = time.perf_counter()
            r = run(plan, *a, **kw)
            times.append((sum(c.n for c in plan.chunks), time.perf_counter() - t0))
            return r

        spec.propose, engine.runner.run = wrong, timed
        try:
            llm.generate(ids, max_tokens=reps + 2, sampling=SamplingParams(temperature=0.0))
        finally:
            spec.propose, engine.runner.run = propose, run
        same = [t for r, t in times[1:] if r == n]  # the first (prompt) step left out
        out[n] = 1e3 * statistics.median(same) if same else float("nan")
    return out


def step_profiles(llm: LLM, rows: list[int], top: int = 12) -> None:
    """For each row count, the recorded one-sequence step of that many rows (the sweep records them):
    its replay's time alone, and its kernels timed one by one (bench/cuda.py's launch_profile)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_cuda", Path(__file__).resolve().parent / "cuda.py")
    bench_cuda = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_cuda)
    runner, backend = llm.engine.runner, llm.model.backend
    if not hasattr(backend, "cp"):
        print("step profiles are taken on CUDA only")
        return
    for n in rows:
        recs = [rec for key, (rec, _) in runner._recordings.items() if key[0] == n and key[1] == 1]
        if not recs:
            print(f"step profile {n} rows: no recording")
            continue
        times = []
        for _ in range(100):
            t0 = time.perf_counter()
            backend.replay(recs[0])
            times.append(time.perf_counter() - t0)
        prof = bench_cuda.launch_profile(backend, recs[0])
        kernels = ", ".join(f"{k} {v[0]}x {v[1]:.0f}" for k, v in list(prof["kernels"].items())[:top])
        print(f"step profile {n} rows: replay {1e3 * statistics.median(times):.3f} ms, launches "
              f"{len(recs[0].launches)}, kernels alone {prof['sum_us']:.0f} us: {kernels}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workloads", default="edit,free")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--spec-types", default="cache,lookup")
    ap.add_argument("--sweep", default="", help="row counts to time a step of (e.g. 1,2,3,4,5,8,12,17)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--step-profile", default="",
                    help="(CUDA, with --sweep) row counts whose recorded one-sequence step is replayed alone and "
                         "its kernels timed one by one (bench/cuda.py's launch_profile), e.g. 1,4,16")
    ap.add_argument("--trace", action="store_true", help="print each request's drafts (see above)")
    args = ap.parse_args()
    path = hub.resolve(args.model)
    prompts = Prompts(path)
    print(f"load {__import__('os').getloadavg()[0]:.2f}")
    trace = DraftTrace() if args.trace else None
    for spec in ("none", args.spec_types):
        slots = 8 if "agent" in args.workloads else 1
        llm = LLM(path, device=args.device, threads=args.threads, slots=slots, ctx=4096, speculative=spec)
        try:
            if args.sweep and spec != "none":
                ms = sweep(llm, prompts.edit(0), [int(x) for x in args.sweep.split(",")])
                print("step ms by rows: " + ", ".join(f"{k}: {v:.1f}" for k, v in ms.items()) +
                      "  (relative: " + ", ".join(f"{k}: {v / ms[min(ms)]:.2f}" for k, v in ms.items()) + ")")
                if args.step_profile:
                    step_profiles(llm, [int(x) for x in args.step_profile.split(",")])
            clock = StepClock(llm)
            prof = cProfile.Profile() if args.profile and spec != "none" else None
            for workload in args.workloads.split(","):
                for rep in range(args.reps):
                    if workload == "agent":
                        agent_split(llm, prompts, rep, clock)
                        continue
                    ids = getattr(prompts, workload)(rep)
                    clock.reset()
                    shapes_before = set(llm.engine.runner._recordings)
                    if prof is not None:
                        step = llm.engine.step

                        def profiled(step=step):
                            prof.runcall(step)
                        llm.engine.step = profiled
                    tps, n = generate(llm, ids, N_PREDICT[workload])
                    if prof is not None:
                        llm.engine.step = step
                    kept = [i for i, s in enumerate(clock.steps) if i > 0 and s[0] < 32]  # the prompt's steps left out
                    gen = [clock.steps[i] for i in kept]
                    compute = sum(s[1] for s in gen)
                    whole = sum(s[2] for s in gen)
                    rows = sum(s[0] for s in gen)
                    first = [clock.steps[i][2] for i in kept if clock.recorded[i]]
                    print(f"{workload} rep {rep} spec={spec}: {tps:.1f} tok/s, {n} tokens, {len(gen)} steps, "
                          f"{rows} rows, compute {1e3 * compute / max(n, 1):.2f} ms/token, host "
                          f"{1e3 * (whole - compute) / max(n, 1):.2f} ms/token "
                          f"({100 * (whole - compute) / max(whole, 1e-9):.1f}% of steps); shapes recorded as they "
                          f"came {len(first)} ({1e3 * sum(first):.1f} ms)"
                          + (f": {sorted(set(llm.engine.runner._recordings) - shapes_before)}" if first else ""),
                          flush=True)
                    if trace is not None and spec != "none":
                        print("  drafts: " + trace.take(), flush=True)
            if prof is not None:
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
                print(s.getvalue())
        finally:
            llm.close()


if __name__ == "__main__":
    main()
