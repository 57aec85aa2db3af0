"""Decode speed of two builds of ember, side by side in one run (not a test).

Each build is a directory holding an `ember` package with its compiled CPU extension (this checkout,
or e.g. `git archive OLD ember | tar -x -C /tmp/old` with the old build's .so copied in). One worker
process per build loads the model once (and waits for the move onto huge pages); then the workers
generate --n-gen tokens in turn, --rounds times after --warmup rounds, so both see the same machine. Prints each build's
tok/s per round, the medians and the second build's ratio to the first; writes JSON (--out). Run it
under bench's quiet.sh.

    python bench/tg_ab.py --builds /tmp/old . [--models llama-8b] [--n-gen 16] [--rounds 8] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import sys, time, json
root = sys.argv[1]
# this build's package, not the one an editable install of the checkout points at
sys.meta_path = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "").lower()]
sys.path.insert(0, root)
sys.path.insert(1, sys.argv[2])
import ladder
from ember.engine import LLM
from ember.sampler import SamplingParams
g = SamplingParams(temperature=0.0, ignore_eos=True)
llm = LLM(str(ladder.ensure(sys.argv[3])), device="cpu", threads=int(sys.argv[4]), ctx=int(sys.argv[5]) + 16)
import ember
llm.generate([1], 4, g)
llm.backend.settled()
print(json.dumps({"ready": ember.__file__}), flush=True)
for line in sys.stdin:
    n = int(line)
    t0 = time.perf_counter()
    llm.generate([7], n, g)
    print(json.dumps({"tps": n / (time.perf_counter() - t0)}), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--builds", nargs=2, required=True)
    ap.add_argument("--models", nargs="+", default=["llama-8b"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-gen", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="rounds run first and not counted")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "tg_ab.json"))
    args = ap.parse_args()
    bench = str(Path(__file__).resolve().parent)
    results = {"builds": args.builds, "threads": args.threads, "n_gen": args.n_gen, "load_before": os.getloadavg(),
               "models": {}}
    print(f"load {os.getloadavg()}")
    for model in args.models:
        workers = []
        for root in args.builds:
            p = subprocess.Popen([sys.executable, "-c", WORKER, str(Path(root).resolve()), bench, model,
                                  str(args.threads), str(args.n_gen)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
            workers.append(p)
        for root, p in zip(args.builds, workers):
            print(f"{model}: {root} -> {json.loads(p.stdout.readline())['ready']}")
        tps = [[] for _ in workers]
        for r in range(-args.warmup, args.rounds):
            order = range(len(workers)) if r % 2 == 0 else reversed(range(len(workers)))
            for i in order:
                workers[i].stdin.write(f"{args.n_gen}\n")
                workers[i].stdin.flush()
                t = json.loads(workers[i].stdout.readline())["tps"]
                if r >= 0:
                    tps[i].append(t)
        for p in workers:
            p.stdin.close()
            p.wait()
        medians = [statistics.median(t) for t in tps]
        for root, t, m in zip(args.builds, tps, medians):
            print(f"  {root}: tg{args.n_gen} median {m:.2f} tok/s  [{', '.join(f'{v:.2f}' for v in t)}]")
        print(f"  {args.builds[1]} / {args.builds[0]}: {medians[1] / medians[0]:.3f}")
        results["models"][model] = {"tps": tps, "medians": medians, "ratio": medians[1] / medians[0]}
    results["load_after"] = os.getloadavg()
    print(f"load {results['load_after']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
