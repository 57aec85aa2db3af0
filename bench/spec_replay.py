"""The draft policy replayed on fixed greedy outputs, priced by a step-cost table: what the length
rule costs against an oracle, without the machine's noise.

    python bench/spec_replay.py [--model smollm2] [--workloads edit,free] [--edit-reps 5] [--free-reps 8]
                                [--table prior|1:1,4:1.57,8:2.38,...] [--cap 32] [--record-cost 0] [--trace]

The greedy outputs of bench/spec.py's edit and free prompts (384 and 128 tokens) are generated once
by ember without drafts and kept in bench/results/. Each request is then replayed through the engine's
own Speculator (ember/engine/speculate.py: the sources of `cache,lookup`, the acceptance estimates,
the length rule, the shared index as one server keeps it across the repetitions), with a sequence that
follows the fixed output: a step keeps the drafted tokens that match it. A step of n rows costs
table[n] one-row steps (`prior`: PRIOR_STEP, what the engine assumes before it measures; or measured
ratios, `rows:ratio` pairs, interpolated); the modeled speedup is tokens over that cost. The oracle
verifies exactly the tokens the lookup's draft would keep (at most --cap): the bound for any length
rule over these sources and costs. Also shown: the share of the cost spent on rejected rows, the step
shapes a fresh server would record (--record-cost one-row steps each, added when > 0), and with
--trace each request's drafts (matched suffix / verified:kept).

Deterministic: a change of the policy shows here exactly, where bench/spec.py's timings move 3-7%
per repetition between identical builds.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from spec import Prompts  # noqa: E402

from ember import hub  # noqa: E402
from ember.engine import speculate  # noqa: E402
from ember.engine.drafts import PromptLookup  # noqa: E402
from ember.engine.sequence import Status  # noqa: E402
from ember.engine.speculate import SpecConfig, Speculator  # noqa: E402

N_PREDICT = {"edit": 384, "free": 128}


def greedy_outputs(model: str, edit_reps: int, free_reps: int) -> dict:
    """{"edit": [(prompt, output), ...], "free": [...]}, generated once and kept beside the results."""
    path = hub.resolve(model)
    cache = Path(__file__).resolve().parent / "results" / f"spec-greedy-{path.stem}.json"
    data = json.loads(cache.read_text()) if cache.exists() else {}
    want = {"edit": edit_reps, "free": free_reps}
    if all(len(data.get(k, [])) >= n for k, n in want.items()):
        return {k: data[k][:n] for k, n in want.items()}
    from ember.engine.llm import LLM
    from ember.sampler import SamplingParams
    prompts = Prompts(path)
    llm = LLM(path, device="cpu", threads=2, slots=1, ctx=4096, speculative="none")
    try:
        for kind, n in want.items():
            for rep in range(len(data.get(kind, [])), n):
                ids = getattr(prompts, kind)(rep)
                out = llm.generate(ids, max_tokens=N_PREDICT[kind], sampling=SamplingParams(temperature=0.0))
                data.setdefault(kind, []).append((ids, list(out.token_ids)))
    finally:
        llm.close()
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(data))
    return {k: data[k][:n] for k, n in want.items()}


def cost_table(text: str) -> tuple[float, ...]:
    """PRIOR_STEP, or measured `rows:ratio` pairs interpolated over 1..33 rows."""
    if text == "prior":
        return speculate.PRIOR_STEP
    pts = dict((int(a), float(b)) for a, b in (p.split(":") for p in text.split(",")))
    xs = sorted(pts)
    return tuple(float(np.interp(n, xs, [pts[x] for x in xs])) for n in range(1, len(speculate.PRIOR_STEP) + 1))


class _Owner:
    def __init__(self, spec):
        self.spec, self.matcher = spec, None


class _Seq:
    """What Speculator.propose and finished read of a sequence."""

    def __init__(self, seq_id: int, tokens: list[int], n_prompt: int, max_new: int, spec):
        self.id, self.tokens, self.owner = seq_id, tokens, _Owner(spec)
        self.status, self.n_pending, self.draft = Status.RUNNING, 1, []
        self.n_prompt, self.max_new_tokens = n_prompt, max_new
        self.n_cache_hit, self.prompt_logits = 0, False

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt


class _NoTree:
    def continuation(self, tokens, limit):  # no request repeats another's whole context here
        return []


def replay(outputs: list, record_cost: float, trace: bool) -> list[dict]:
    """The policy over one server's requests in order: per request, modeled speedup and its parts."""
    spec = Speculator(SpecConfig(types=("cache", "lookup")), _NoTree(), 1 << 20)
    recorded: set[int] = {1}
    out = []
    for seq_id, (ids, gen) in enumerate(outputs):
        st = spec.state_for(None)
        seq = _Seq(seq_id, list(ids) + gen[:1], len(ids), len(gen), st)
        cost = rejected = 0.0
        steps = new_shapes = 0
        items = []
        while seq.n_generated < len(gen):
            spec.propose([seq])
            draft, at = seq.draft, seq.n_generated
            kept = 0
            while kept < len(draft) and at + kept < len(gen) and draft[kept] == gen[at + kept]:
                kept += 1
            if draft:
                st.drafted += len(draft)
                st.accepted += kept
                st.adapt(len(draft), kept)
                items.append(f"{st.source[:1]}{len(draft)}:{kept}")
            rows = len(draft) + 1
            cost += speculate._prior(rows)
            rejected += speculate._prior(rows) - speculate._prior(kept + 1)
            if rows not in recorded:
                recorded.add(rows)
                new_shapes += 1
                cost += record_cost
            steps += 1
            seq.tokens.extend(gen[at:at + kept + 1])
        seq.status = Status.FINISHED
        spec.finished(seq)
        out.append({"speedup": len(gen) / cost, "steps": steps, "rejected_share": rejected / cost,
                    "new_shapes": new_shapes, "drafted": st.drafted, "kept": st.accepted,
                    "trace": " ".join(items) if trace else None})
    return out


def oracle(outputs: list, cap: int) -> list[float]:
    """Each step verifies exactly the tokens of the lookup's draft (then the index's) that match the output."""
    from ember.engine.drafts import NgramIndex
    index = NgramIndex(64 << 20)
    out = []
    for ids, gen in outputs:
        lookup, tokens, cost, at = PromptLookup(), list(ids) + gen[:1], 0.0, 1
        while at < len(gen):
            room = min(cap, len(gen) - at - 1)
            draft = (lookup.find(tokens, room) or index.find(tokens, room)) if room > 0 else []
            kept = 0
            while kept < len(draft) and draft[kept] == gen[at + kept]:
                kept += 1
            cost += speculate._prior(kept + 1)
            tokens.extend(gen[at:at + kept + 1])
            at += kept + 1
        index.add(tokens, len(ids))
        out.append(len(gen) / cost)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--workloads", default="edit,free")
    ap.add_argument("--edit-reps", type=int, default=5)
    ap.add_argument("--free-reps", type=int, default=8)
    ap.add_argument("--table", default="prior", help="prior, or measured rows:ratio pairs (see above)")
    ap.add_argument("--cap", type=int, default=32, help="the oracle's longest draft")
    ap.add_argument("--record-cost", type=float, default=0.0, help="one-row steps a new step shape costs")
    ap.add_argument("--trace", action="store_true")
    args = ap.parse_args()
    speculate.PRIOR_STEP = cost_table(args.table)
    data = greedy_outputs(args.model, args.edit_reps, args.free_reps)
    for kind in args.workloads.split(","):
        runs, bound = replay(data[kind], args.record_cost, args.trace), oracle(data[kind], args.cap)
        mean = sum(r["speedup"] for r in runs) / len(runs)
        speedups = " ".join(f"{r['speedup']:.2f}" for r in runs)
        print(f"{kind}: policy {speedups} (mean {mean:.3f}); oracle "
              f"{' '.join(f'{b:.2f}' for b in bound)} (mean {sum(bound) / len(bound):.3f})")
        for rep, r in enumerate(runs):
            print(f"  rep {rep}: {r['steps']} steps, drafted {r['drafted']} kept {r['kept']}, rejected rows "
                  f"{100 * r['rejected_share']:.1f}% of the cost, {r['new_shapes']} new step shapes"
                  + (f"\n    {r['trace']}" if r["trace"] else ""))


if __name__ == "__main__":
    main()
