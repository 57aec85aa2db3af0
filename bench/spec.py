"""Speculative decoding on agent-like work: ember with and without drafts, llama-server with and
without its draftless modes, all over HTTP (/completion, greedy, the same token ids).

Source `draft` (a draft model) needs a larger model of the same vocabulary than the one drafting:
the model's own weights requantized (--draft-target, default f16, written once into
bench/results/) are the model there, and the model file (--model) drafts for it. Those engines
(`ember:f16`, `ember:f16+draft`, and llama-server's `llama-server:f16`, `llama-server:f16+draft`)
are compared with each other; their ratio is against `ember:f16`.

Workloads (each repetition uses new content, so nothing is served from an earlier repetition):
  edit    a code edit: the prompt holds a source file of this repository and asks for it back with
          one rename; generation tokens/s of the one request (timings.predicted_per_second)
  agent   8 sessions sharing one system prompt with tool definitions, several turns each, whose
          earlier turns hold tool calls with their arguments; all sessions at once, generated
          tokens over the wall time of the whole run (prompts included), and each request's own
          generation rate (median)
  free    free text that does not repeat (short stories on assorted topics), one at a time

Engines alternate within each repetition; medians over repetitions. Acceptance: drafted and kept
tokens from each reply's timings (draft_n, draft_n_accepted). The load average is noted before
and after. Writes bench/results/spec.json.

    python bench/spec.py [--model smollm2] [--device cpu] [--threads 2] [--reps 3] [--peer-types ngram-simple,ngram-mod]
                         [--workloads edit,agent,free] [--sources spec,draft] [--draft-target f16] [--draft-p-min P]
                         [--skip-peer] [--peer-poll 0] [--first-rep 0] [--engines ember,ember+spec]

Under a time limit (a quiet run), run one workload and a few repetitions a call: --first-rep picks
which repetitions (each has its own content), --engines which engines of the table run.
--old-tree DIR (a checkout with its C extension built, e.g. the commit before a change) adds that
checkout's speculative engine, `old:ember+spec`, to the same run: both builds alternate in every
repetition, their ratios against the same `ember`.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import peer  # noqa: E402
from agent import _free_port, _when_ready, system_prompt  # noqa: E402
from gguf_edit import requantized  # noqa: E402

from ember import hub  # noqa: E402
from ember.tokenizer import Tokenizer  # noqa: E402
from ember.tokenizer.chat import ChatTemplate  # noqa: E402
from ember.gguf_loader import GGUFFile  # noqa: E402
from ember.quant import GGMLType  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EDIT_FILES = ("ember/engine/pages.py", "ember/engine/sequence.py", "ember/engine/budget.py",
              "ember/engine/ahead.py", "ember/server/sse.py")
TOPICS = ("a lighthouse keeper", "a lost umbrella", "the first snow in a desert town", "a chess tournament",
          "a bakery at midnight", "a broken clock", "a river that flows uphill", "an old map")
CTX = 4096


# ---- prompts (token ids, from the model's own template) ----

class Prompts:
    def __init__(self, path: Path):
        with GGUFFile(path) as f:
            self.tokenizer = Tokenizer.from_metadata(f.metadata)
            self.template = ChatTemplate.from_metadata(f.metadata)

    def chat(self, messages: list[dict]) -> list[int]:
        return self.template.encode(self.tokenizer, self.template.render(messages, add_generation_prompt=True))

    def edit(self, rep: int) -> list[int]:
        source = (ROOT / EDIT_FILES[rep % len(EDIT_FILES)]).read_text()
        ask = "Rename every `seq` to `sequence` in this file and return the whole file, nothing else."
        return self.chat([{"role": "user", "content": f"{ask}\n\n```python\n{source}```"}])

    def agent(self, rep: int, sessions: int, turns: int) -> list[list[list[int]]]:
        """Per session, the prompt of each turn: the shared system prompt, then the session's turns
        so far, each a user request and the assistant's tool call with the arguments it named."""
        system = system_prompt(1200, lambda t: self.tokenizer.encode(t))
        rng = random.Random(rep)
        out = []
        for s in range(sessions):
            city, day = rng.choice(("Lisbon", "Osaka", "Quito", "Tromso", "Accra")), rng.randrange(1, 28)
            messages = [{"role": "system", "content": system}]
            prompts = []
            for t in range(turns):
                ask = (f"Session {s}, step {t}: look up the weather in {city} on 2025-03-{day:02d} and then "
                       f"send the report to ops-{s}@example.com with the subject \"{city} report {t}\".")
                messages.append({"role": "user", "content": ask})
                prompts.append(self.chat(messages))
                call = {"name": "get_weather", "arguments": {"city": city, "date": f"2025-03-{day:02d}",
                                                             "notify": f"ops-{s}@example.com"}}
                messages.append({"role": "assistant", "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"})
                messages.append({"role": "user", "content": f"Tool result: {city} {day} March: 14C, clear."})
            out.append(prompts)
        return out

    def free(self, rep: int) -> list[int]:
        topic = TOPICS[rep % len(TOPICS)]
        return self.chat([{"role": "user", "content": f"Write a short, original story about {topic}."}])


# ---- engines ----

def complete(port: int, ids: list[int], n_predict: int) -> dict:
    body = json.dumps({"prompt": ids, "n_predict": n_predict, "temperature": 0, "cache_prompt": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as resp:
        return json.loads(resp.read())


def start_ember(model: str, threads: int, slots: int, spec: str, draft: str | None = None,
                p_min: float | None = None, tree: str | None = None, device: str = "cpu") -> tuple[object, int]:
    """tree: another checkout of ember to run (its package first on the path), else this one."""
    port = _free_port()
    cmd = [sys.executable, "-m", "ember", "serve", model, "--port", str(port), "--slots", str(slots),
           "--threads", str(threads), "--ctx", str(CTX), "--device", device, "--log-level", "warning",
           "--spec-type", spec] + (["--model-draft", draft] if draft else [])
    if draft and p_min is not None:
        cmd += ["--draft-p-min", str(p_min)]
    env = dict(os.environ, PYTHONPATH=tree) if tree else None
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tree, env=env)
    return _when_ready(proc, port, "ember serve"), port


def start_llama(path: Path, threads: int, slots: int, spec: str, poll: int | None,
                draft: str | None = None, p_min: float | None = None) -> tuple[object, int]:
    port = _free_port()
    args = ["-m", str(path), "-t", str(threads), "-np", str(slots), "-c", str(CTX * slots), "--port", str(port),
            "--host", "127.0.0.1", "--no-webui", "--spec-type", spec]
    if draft:  # its draft-model defaults otherwise (3 tokens a draft, no probability floor)
        args += ["--model-draft", draft, "--threads-draft", str(threads)]
        if p_min is not None:
            args += ["--spec-draft-p-min", str(p_min)]
    if poll is not None:  # its threads spin waiting for work by default: on a loaded machine that collapses
        args += ["--poll", str(poll)]
    proc = peer.popen("llama-server", args, probe_model=str(path))
    return _when_ready(proc, port, "llama-server"), port


# ---- workloads: one run each -> {"tps": ..., "tokens": ..., "drafted": ..., "accepted": ...} ----

def _drafts(replies: list[dict]) -> dict:
    drafted = sum(r["timings"].get("draft_n", 0) for r in replies)
    accepted = sum(r["timings"].get("draft_n_accepted", 0) for r in replies)
    steps_with_draft = drafted and sum(1 for r in replies if r["timings"].get("draft_n"))
    return {"tokens": sum(r["timings"]["predicted_n"] for r in replies), "drafted": drafted, "accepted": accepted,
            "requests_drafting": steps_with_draft}


def run_edit(port: int, prompts: Prompts, rep: int, n_predict: int) -> dict:
    r = complete(port, prompts.edit(rep), n_predict)
    return {"tps": r["timings"]["predicted_per_second"], **_drafts([r])}


def run_free(port: int, prompts: Prompts, rep: int, n_predict: int) -> dict:
    replies = [complete(port, prompts.free(rep * 2 + i), n_predict) for i in range(2)]
    tps = statistics.mean(r["timings"]["predicted_per_second"] for r in replies)
    return {"tps": tps, **_drafts(replies)}


def run_agent(port: int, prompts: Prompts, rep: int, n_predict: int, sessions: int = 8, turns: int = 3) -> dict:
    sessions_prompts = prompts.agent(rep, sessions, turns)

    def session(turn_prompts):
        return [complete(port, ids, n_predict) for ids in turn_prompts]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(sessions) as pool:
        replies = [r for rs in pool.map(session, sessions_prompts) for r in rs]
    wall = time.perf_counter() - t0
    d = _drafts(replies)
    per_request = statistics.median(r["timings"]["predicted_per_second"] for r in replies)
    return {"tps": d["tokens"] / wall, "wall_s": wall, "request_tps_median": per_request, **d}


def draft_sources(port: int) -> dict:
    """ember's drafts by source from its /metrics: drafts, tokens, kept, acceptance, mean kept per draft."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as resp:
        text = resp.read().decode()
    out: dict = {}
    for line in text.splitlines():
        for key, name in (("drafts", "ember:drafts_total"), ("drafted", "ember:draft_tokens_total"),
                          ("accepted", "ember:draft_tokens_accepted_total")):
            if line.startswith(name + "{"):
                source = line.split('source="')[1].split('"')[0]
                out.setdefault(source, {})[key] = float(line.split()[-1])
    for s in out.values():
        s["acceptance"] = s["accepted"] / s["drafted"] if s.get("drafted") else None
        s["kept_per_draft"] = s["accepted"] / s["drafts"] if s.get("drafts") else None
    return out


WORKLOADS = {"edit": (run_edit, 384), "agent": (run_agent, 64), "free": (run_free, 128)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="ember's device (cpu, cuda, webgpu); llama-server runs on the CPU")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workloads", default="edit,agent,free")
    ap.add_argument("--spec-types", default="cache,lookup", help="ember's draft sources when on")
    ap.add_argument("--peer-types", default="ngram-simple,ngram-mod", help="llama-server's modes besides none")
    ap.add_argument("--sources", default="spec,draft",
                    help="spec: ember with --spec-types against none; draft: a draft model (see above)")
    ap.add_argument("--draft-target", default="f16", choices=["f16", "q8_0"],
                    help="the model's weights at this type are the model the model file drafts for")
    ap.add_argument("--draft-p-min", type=float, default=None,
                    help="both engines' draft-model probability floor (default: each its own, 0.75 and 0)")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--peer-poll", type=int, default=None, help="llama-server's --poll (default: its own, 50)")
    ap.add_argument("--first-rep", type=int, default=0, help="the first repetition's number (its content)")
    ap.add_argument("--engines", default="", help="only these engines of the table (comma-separated names)")
    ap.add_argument("--old-tree", default="",
                    help="another checkout of ember (its C extension built): adds `old:ember+spec`, its "
                         "speculative engine, alternating with this tree's in every repetition")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "spec.json"))
    args = ap.parse_args()
    path = hub.resolve(args.model)
    prompts = Prompts(path)
    engines = engine_table(args, path)
    if args.engines:
        wanted = args.engines.split(",")
        unknown = [e for e in wanted if e not in engines]
        if unknown:
            ap.error(f"unknown engines {unknown} (known: {', '.join(engines)})")
        engines = {e: engines[e] for e in wanted}
    load_before = os.getloadavg()
    runs: dict = {w: {e: [] for e in engines} for w in args.workloads.split(",")}
    sources: dict = {}
    for workload in runs:
        fn, n_predict = WORKLOADS[workload]
        slots = 8 if workload == "agent" else 1
        servers = {}
        try:
            for name, (kind, spec, model, draft) in engines.items():
                tree = args.old_tree if name.startswith("old:") else None
                servers[name] = (start_ember(str(model), args.threads, slots, spec, draft, args.draft_p_min, tree,
                                             args.device)
                                 if kind == "ember" else
                                 start_llama(model, args.threads, slots, spec, args.peer_poll, draft, args.draft_p_min))
            for rep in range(args.first_rep, args.first_rep + args.reps):
                for name in (engines if rep % 2 == 0 else list(engines)[::-1]):
                    result = fn(servers[name][1], prompts, rep, n_predict)
                    runs[workload][name].append(result)
                    print(f"{workload} rep {rep} {name}: {result['tps']:.1f} tok/s, {result['tokens']} tokens, "
                          f"drafted {result['drafted']}, kept {result['accepted']}", flush=True)
            sources[workload] = {name: draft_sources(servers[name][1]) for name in servers
                                 if name.startswith(("ember", "old:")) and "+" in name}
        finally:
            for proc, _ in servers.values():
                proc.kill()
                proc.wait()
    summary = summarize(runs)
    out = {"model": args.model, "device": args.device, "threads": args.threads, "reps": args.reps, "first_rep": args.first_rep, "peer_poll": args.peer_poll,
           "draft_target": args.draft_target, "draft_p_min": args.draft_p_min,
           "load_before": load_before, "load_after": os.getloadavg(), "runs": runs, "summary": summary,
           "ember_draft_sources": sources}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({"load_before": load_before, "load_after": out["load_after"], "summary": summary,
                      "ember_draft_sources": sources}, indent=1))


def engine_table(args, path: Path) -> dict:
    """name -> (kind, spec types, model file, draft model file or None)."""
    groups = args.sources.split(",")
    peers = not args.skip_peer and peer.available()
    engines: dict = {}
    if "spec" in groups:
        engines["ember"] = ("ember", "none", path, None)
        engines["ember+spec"] = ("ember", args.spec_types, path, None)
        if args.old_tree:
            engines["old:ember+spec"] = ("ember", args.spec_types, path, None)
        if peers:
            engines["llama-server"] = ("llama", "none", path, None)
            for t in filter(None, args.peer_types.split(",")):
                engines[f"llama-server+{t}"] = ("llama", t, path, None)
    if "draft" in groups:
        kind = args.draft_target
        target = draft_target(path, kind)
        engines[f"ember:{kind}"] = ("ember", "none", target, None)
        engines[f"ember:{kind}+draft"] = ("ember", "draft", target, str(path))
        if peers:
            engines[f"llama-server:{kind}"] = ("llama", "none", target, None)
            engines[f"llama-server:{kind}+draft"] = ("llama", "draft-simple", target, str(path))
    return engines


def draft_target(path: Path, kind: str) -> Path:
    """The model's weights requantized to `kind`, written once beside the results."""
    out = Path(__file__).resolve().parent / "results" / f"{path.stem}.as-{kind}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        requantized(path, out, int(GGMLType[kind.upper()]))
    return out


def _baseline(name: str) -> str:
    """The engine a ratio is taken against: ember on the same model without speculation."""
    return name.split("+")[0] if name.startswith("ember:") else "ember"


def summarize(runs: dict) -> dict:
    out = {}
    for workload, engines in runs.items():
        row = {}
        for name, results in engines.items():
            if not results:
                continue
            drafted = sum(r["drafted"] for r in results)
            accepted = sum(r["accepted"] for r in results)
            row[name] = {"tps_median": statistics.median(r["tps"] for r in results),
                         "acceptance": accepted / drafted if drafted else None,
                         "drafted": drafted, "accepted": accepted}
        for name, r in row.items():
            base = row.get(_baseline(name), {}).get("tps_median")
            r["vs_ember"] = r["tps_median"] / base if base else None
        peers = [r["tps_median"] for n, r in row.items() if n.startswith("llama-server") and ":" not in n]
        if peers and "ember+spec" in row:
            row["ember+spec"]["vs_best_peer"] = row["ember+spec"]["tps_median"] / max(peers)
        for name in [n for n in row if n.startswith("ember:") and n.endswith("+draft")]:
            peer_name = "llama-server:" + name.split(":", 1)[1]
            if peer_name in row:
                row[name]["vs_peer"] = row[name]["tps_median"] / row[peer_name]["tps_median"]
        out[workload] = row
    return out


if __name__ == "__main__":
    main()
