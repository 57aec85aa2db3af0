"""Why a decode product reads slower inside the replayed step than alone (not a test).

Loads a model on the CPU backend, records one decode step, then replays chosen ops of that recording
(the real buffers, weights on huge pages as in serving) with per-op native timing:

  step      the whole step, as a token is generated
  ffn       each layer's gate/up product, silu_mul and down product, layer after layer
  gu-down   each layer's gate/up product, then its down product (no silu_mul)
  down      each layer's down product alone, layer after layer (every product from DRAM: the layers'
            weights are far larger than the L3)
  down-one  one layer's down product, called back to back (its weights stay in the L3 after the first)

For every mode, the products' GB/s (weight bytes / native time) by label: median over the calls.
Run under bench's quiet.sh. The replayed ops write the step's own buffers, so values are garbage after
the first partial replay: only the timing means anything.

    python bench/step_ops.py [--models llama-8b] [--threads 2] [--reps 5] [--modes step ffn down]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ladder  # noqa: E402

from ember.backends.cpu import op_label, op_weight_bytes  # noqa: E402
from ember.backends.cpu._native import ffi, lib  # noqa: E402
from ember.engine import LLM  # noqa: E402
from ember.sampler import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def capture_step(llm):
    """The recording of a one-token decode step."""
    backend, seen = llm.backend, []
    replay = backend.replay

    def keep(rec):
        seen.append(rec)
        replay(rec)

    backend.replay = keep
    try:
        llm.generate([1], 3, GREEDY)
    finally:
        del backend.replay
    return max(seen[-2:], key=lambda r: len(r.ops))


def layers(rec) -> list[dict]:
    """Per layer, the op indices of its gate/up product, silu_mul and down product."""
    out, cur = [], {}
    for k in range(len(rec.ops)):
        op = rec.array[k]
        if op.kind == lib.EMBER_OP_MATMUL_MULTI and int(op.i[0]) == 2 and op_label(op).count("x") == 1 \
                and int(ffi.cast("int64_t *", op.p[2])[0]) > int(op.i[1]):
            cur = {"gu": k}
        elif op.kind == lib.EMBER_OP_SILU_MUL and "gu" in cur:
            cur["silu"] = k
        elif op.kind == lib.EMBER_OP_MATMUL and "silu" in cur:
            cur["down"] = k
            out.append(cur)
            cur = {}
    return out


def run(pool, rec, idx: list[int], times: dict, labels: list[str], nbytes: list[int], kinds: dict | None = None) -> None:
    """Replays ops idx (in that order) once, adding each product's GB/s under its label (and, given
    kinds, each op kind's total ms of the pass)."""
    arr = ffi.new("ember_op[]", len(idx))
    for j, k in enumerate(idx):
        arr[j] = rec.array[k]
    ns = np.zeros(len(idx), np.int64)
    failed = lib.ember_run_ops_timed(pool, arr, len(idx), ffi.cast("int64_t *", ns.ctypes.data))
    assert failed < 0, failed
    for j, k in enumerate(idx):
        if nbytes[k]:
            times[labels[k]].append(nbytes[k] / ns[j])
    if kinds is not None:
        by = defaultdict(float)
        for j, k in enumerate(idx):
            by["products" if nbytes[k] else labels[k]] += ns[j] / 1e6
        by["all"] = ns.sum() / 1e6
        for key, v in by.items():
            kinds[key].append(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama-8b"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--modes", nargs="+", default=["step", "ffn", "gu-down", "down", "down-one"])
    args = ap.parse_args()
    print(f"load {os.getloadavg()}")
    for name in args.models:
        llm = LLM(str(ladder.ensure(name)), device="cpu", threads=args.threads, ctx=64)
        llm.generate([1], 4, GREEDY)
        llm.backend.settled()
        rec = capture_step(llm)
        pool = llm.backend._pool
        labels = [op_label(rec.array[k]) for k in range(len(rec.ops))]
        nbytes = [op_weight_bytes(rec.array[k]) for k in range(len(rec.ops))]
        lay = layers(rec)
        print(f"{name}: {len(rec.ops)} ops a step, {len(lay)} layers found")
        for mode in args.modes:
            times, kinds = defaultdict(list), defaultdict(list)
            # alternate a whole step between the modes' passes so that every pass starts from a step's state
            for _ in range(args.reps):
                if mode == "step":
                    run(pool, rec, list(range(len(rec.ops))), times, labels, nbytes, kinds)
                elif mode == "ffn":
                    for L in lay:
                        run(pool, rec, [L["gu"], L["silu"], L["down"]], times, labels, nbytes)
                elif mode == "gu-down":
                    for L in lay:
                        run(pool, rec, [L["gu"], L["down"]], times, labels, nbytes)
                elif mode == "down":
                    for L in lay:
                        run(pool, rec, [L["down"]], times, labels, nbytes)
                elif mode == "down-one":
                    for L in lay[:1] * 16:
                        run(pool, rec, [L["down"]], times, labels, nbytes)
            print(f"  {mode}:" + ("" if not kinds else " ms a step: " + ", ".join(
                f"{key} {statistics.median(v):.2f}" for key, v in sorted(kinds.items(), key=lambda kv: -max(kv[1])))))
            for label, v in sorted(times.items(), key=lambda kv: kv[0]):
                if len(v) >= args.reps:
                    q = np.percentile(v, [25, 50, 75])
                    print(f"    {label:44} {statistics.median(v):6.1f} GB/s  (q1 {q[0]:5.1f}, q3 {q[2]:5.1f}, n {len(v)})")
        llm.close()
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
