"""WebGPU speed: ember's WebGPU backend beside ember's CPU backend and llama.cpp's CPU build
(llama-bench) on the same file, in the same run, and the host's share of a WebGPU decode step.
With --llama-bin DIR, also beside a GPU build of llama.cpp (its Vulkan backend on the same adapter:
bench/webgpu_device_run.sh builds it), its first run untimed (it compiles the shaders then). With
--many N, also N streams at once through the engine (each step's time, and whether its shape was
recorded then), beside that build's llama-batched-bench, run before ember opens the adapter.
The WebGPU backend runs twice: as served (decode steps queued while the one before runs, their
tokens chosen on the device) and `webgpu-serial` (each step queued once the host has read the one
before: the host's time and the adapter's take turns).

For each model: prompt processing (ppN: N tokens in one batch from an empty context) and generation
(tgN: N greedy tokens one at a time), the three runs alternating --reps times so that all see the
same machine; medians. Then a recorded decode step of the WebGPU backend replayed --reps times:
the host time to write its inputs, encode its command buffer and submit it; the adapter's own time
for the step's compute pass (timestamp queries, where the adapter has them), and each dispatch
timed alone, summed by kernel; and the host's wait from submit to the best ids in hand; the same
for the prompt step. On lavapipe (Mesa's software Vulkan driver) the "GPU" is this
machine's cores: the figures say how the backend behaves, not how a GPU
would run it. Writes JSON (default bench/results/webgpu.json).

With --products REV: the prompt kernel alone instead, on the GPU plan (tiles, `mm`) whatever the
adapter: each model's first layer's products as its prompt step dispatches them (queries, keys
and values in one; the output; gate and up in one; down) on --n-prompt random activation rows,
each dispatch timed by timestamp queries, beside the same dispatches through the `mm` of git
revision REV (its matmul.wgsl in this tree's module, or a copy of one at the path REV;
--products-tile: its tile) and through mv_row (a thread a weight row: the CPU adapters' kernel
for a few rows), alternating; medians and GFLOP/s.

With --lanes: the decode kernel alone (one activation row) on each model's first-layer products
and output head, built with 32, 64 and 128 lanes a workgroup, each dispatch timed by timestamp
queries, alternating; medians. The int8 products (mvq, at every row length: served from
INT8_MIN_K values) and x's rounding (quant_q8) beside the f32 ones: Q4_K's and Q6_K's own entry
(mvk) and the generic piece kernel (mvp). Served one-row builds: mvp at 128 lanes below 16,384
weight rows, 32 above; Q4_K's and Q6_K's mvq at 64 below, 32 above.

    python bench/webgpu.py [--models smollm2 gemma3-270m=PATH] [--device webgpu] [--n-prompt 64]
                           [--n-gen 16] [--reps 3] [--threads 2] [--no-cpu] [--llama-bin DIR] [--many N]
                           [--products REV [--products-tile 32]] [--lanes]
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer  # noqa: E402
from cpu import cpu_name, llama_bench, machine_load  # noqa: E402

from ember import hub  # noqa: E402
from ember.engine import LLM  # noqa: E402
from ember.sampler import SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GPU_PEER = "llama.cpp-gpu"  # --llama-bin's runs
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def ignore(logits, positions):  # the logits are computed, not needed
    return None


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Runner:
    """One ember backend on a model, warmed up (pipelines compiled, steps recorded)."""

    def __init__(self, path: Path, device: str, threads: int, n_prompt: int, n_gen: int, ahead: bool | None = None,
                 attention: str | None = None):
        self.llm = LLM(str(path), device=device, threads=threads, ctx=n_prompt + n_gen + 16, batch=n_prompt,
                       decode_ahead=ahead)
        if attention is not None:  # the prompt-attention kernel, before any step is recorded
            backend = self.llm.backend
            backend.tile_attention, backend.flash_attention = attention == "attn_tile", attention == "attn_flash"
        self.n_prompt, self.n_gen = n_prompt, n_gen
        self.vocab = min(self.llm.model.n_vocab, 32000)
        rng = np.random.default_rng(0)
        for _ in range(2):  # the second run of a shape replays its recording
            self.pp(rng)
            self.llm.generate([1], 4, GREEDY)

    def pp(self, rng) -> float:
        prompt = rng.integers(0, self.vocab, self.n_prompt).tolist()
        return self.n_prompt / _timed(lambda: self.llm.evaluate(prompt, ignore, logits_from=self.n_prompt - 1))

    def tg(self, rng) -> float:
        first = int(rng.integers(0, self.vocab))
        return self.n_gen / _timed(lambda: self.llm.generate([first], self.n_gen, GREEDY))


def host_share(runner: Runner, reps: int) -> dict:
    """A recorded decode step replayed: the host's time to write its inputs, encode its command
    buffer and submit it (host_ms), the adapter's time for the step's compute pass (gpu_ms, by
    timestamp queries where the adapter has them), and the host's wait from submit to the best ids
    in hand (wait_ms: the GPU time, the readback and the driver's latency); medians."""
    backend = runner.llm.backend
    runner.llm.generate([1], 2, GREEDY)  # the last step run is then a recorded decode step
    out = step_share(backend, backend.last_step, reps)
    out.update(tg_steps(runner, reps))
    return out


def tg_steps(runner: Runner, reps: int) -> dict:
    """A tgN run's steps as the engine queued them: the host's time from one step's submit to the
    next (submit_ms: the step's whole cost where the adapter is the slower), and the adapter's time
    for the run's last decode step, whose keys reach N positions (gpu_ms_end: against gpu_ms, at 2
    positions, what the longer attention adds)."""
    backend = runner.llm.backend
    stamps, replay = [], backend.replay

    def noted(rec, wait=True):
        stamps.append(time.perf_counter())
        replay(rec, wait)

    backend.replay = noted
    try:
        runner.llm.generate([1], runner.n_gen, GREEDY)
    finally:
        del backend.replay
    gaps = np.diff(stamps)[2:]  # from the third step on: the two before fill the queue
    out = {"submit_ms": None, "submit_ms_p90": None, "steps_replayed": len(stamps),
           "gpu_ms_end": gpu_ms(backend, backend.last_step, max(reps, 5))}
    if gaps.size:
        out["submit_ms"], out["submit_ms_p90"] = 1e3 * float(np.median(gaps)), 1e3 * float(np.percentile(gaps, 90))
    return out


def gpu_ms(backend, step, reps: int) -> float | None:
    """The adapter's time for a recorded step's one pass, median of reps (Step.gpu_time; inputs as
    its last run left them), or None without timestamp queries."""
    if "timestamp-query" not in backend.device.features:
        return None
    return 1e3 * statistics.median(step.gpu_time(backend.device, backend.wgpu) for _ in range(reps))


def prompt_share(runner: Runner, reps: int) -> dict:
    """host_share's figures for the prompt step (ppN): its dispatches, host and GPU time, and
    where the GPU time goes by kernel."""
    runner.pp(np.random.default_rng(2))  # the last step run is then the prompt's (recorded)
    return step_share(runner.llm.backend, runner.llm.backend.last_step, reps)


def step_share(backend, step, reps: int) -> dict:
    timed = "timestamp-query" in backend.device.features
    encode, wait, gpu = [], [], []
    for _ in range(max(reps, 5)):
        backend.replay(step)
        encode.append(step.encode_s)
        wait.append(step.wait_s)
        if timed:
            gpu.append(step.gpu_time(backend.device, backend.wgpu))
    return {"dispatches": len(step.dispatches), "encoder": encoder_kind(), "host_ms": 1e3 * statistics.median(encode),
            "host_ms_min": 1e3 * min(encode), "wait_ms": 1e3 * statistics.median(wait),
            "gpu_ms": 1e3 * statistics.median(gpu) if gpu else None,
            "host_us_per_dispatch": 1e6 * statistics.median(encode) / max(1, len(step.dispatches)),
            "kernels": kernel_profile(backend, step, reps) if timed else None,
            "largest": largest_dispatches(backend, step, reps) if timed else None}


def kernel_profile(backend, step, reps: int) -> list[dict]:
    """Where the adapter's time in a decode step goes: each dispatch timed alone (a compute pass of
    its own, timestamps at its ends; median of the reps), summed by kernel (its module and entry
    point), largest first. The sum against the whole step's gpu_ms tells the kernels from what the
    step's one pass adds or hides between them (barriers, idle units, overlap)."""
    names = backend.kernels.names()
    runs = np.median([step.gpu_times(backend.device, backend.wgpu) for _ in range(max(reps, 3))], axis=0)
    by_kernel: dict[str, list] = {}
    for d, ns in zip(step.dispatches, runs):
        module, entry = names.get(id(d.pipeline), ("?", "?"))
        entry_ = by_kernel.setdefault(f"{module}:{entry}", [0, 0.0])
        entry_[0] += 1
        entry_[1] += float(ns)
    rows = [{"kernel": k, "dispatches": n, "ms": 1e-6 * ns} for k, (n, ns) in by_kernel.items()]
    return sorted(rows, key=lambda r: -r["ms"])


def largest_dispatches(backend, step, reps: int, count: int = 8) -> list[dict]:
    """The step's `count` longest dispatches, each timed alone (median of the reps): kernel, its
    first parameters (a product's rows and k) and workgroups."""
    names = backend.kernels.names()
    runs = np.median([step.gpu_times(backend.device, backend.wgpu) for _ in range(max(reps, 3))], axis=0)
    order = np.argsort(-runs)[:count]
    return [{"kernel": ":".join(names.get(id(step.dispatches[i].pipeline), ("?", "?"))),
             "params": [int(v) for v in step.dispatches[i].params[:4]], "groups": list(step.dispatches[i].groups),
             "us": 1e-3 * float(runs[i])} for i in order]


def encoder_kind() -> str:
    """How replays encode their dispatches: csrc/encode.c, a Python loop, or wgpu-py's methods."""
    from ember.backends.webgpu import _step

    native = _step.native_encoder()
    if native is None:
        return "wgpu-py methods"
    return "a Python loop" if native[0].__qualname__.startswith("_python_encoder") else "native"


def model_path(spec: str) -> Path:
    """spec: a model name, or NAME=PATH (a file elsewhere, e.g. a skeleton unpacked on a GPU machine)."""
    name, _, where = spec.partition("=")
    return Path(where) if where else hub.resolve(name)


def bench_model(spec: str, args, peer_many: dict) -> dict:
    path = model_path(spec)
    if args.many_only:  # the N-stream run alone (a variant's run beside a full one)
        return {"path": str(path), "many": many_block(spec, path, args, peer_many)}
    rng = np.random.default_rng(1)
    runners = {"webgpu": Runner(path, args.device, args.threads, args.n_prompt, args.n_gen),
               # each decode step queued once the host has read the one before (no decode-ahead)
               "webgpu-serial": Runner(path, args.device, args.threads, args.n_prompt, args.n_gen, ahead=False)}
    if args.attention_ab:  # the other prompt-attention kernels (attn_flash where the adapter has its memory)
        backend = runners["webgpu"].llm.backend
        served = "attn_flash" if backend.flash_attention else "attn_tile" if backend.tile_attention else "attention"
        from ember.backends.webgpu import FL_STORAGE

        flash_fits = int(backend.device.limits["max-compute-workgroup-storage-size"]) >= FL_STORAGE
        for kernel in ("attn_flash", "attention", "attn_tile"):
            if kernel != served and (kernel != "attn_flash" or flash_fits):
                runners[f"webgpu-{kernel}"] = Runner(path, args.device, args.threads, args.n_prompt, args.n_gen,
                                                     attention=kernel)
    if not args.no_cpu:
        runners["cpu"] = Runner(path, "cpu", args.threads, args.n_prompt, args.n_gen)
    samples: dict = {key: {"pp": [], "tg": []} for key in (*runners, "llama.cpp", GPU_PEER)}
    variant, gpu_peer = "?", None
    if args.llama_bin:  # its first run compiles the shaders it has not cached: not timed
        gpu_peer = llama_gpu_bench(args.llama_bin, path, args.n_prompt, args.n_gen)
    for _ in range(args.reps):
        for key, runner in runners.items():
            samples[key]["pp"].append(runner.pp(rng))
            samples[key]["tg"].append(runner.tg(rng))
        if args.llama_bin:
            gpu_peer = llama_gpu_bench(args.llama_bin, path, args.n_prompt, args.n_gen)
            samples[GPU_PEER]["pp"] += gpu_peer["pp_samples"]
            samples[GPU_PEER]["tg"] += gpu_peer["tg_samples"]
        if peer.available() and not args.no_cpu:
            run = llama_bench(path, args.threads, 1, args.n_prompt, args.n_gen)
            samples["llama.cpp"]["pp"] += run["pp_samples"]
            samples["llama.cpp"]["tg"] += run["tg_samples"]
            variant = run["variant"]
    out = {"path": str(path), "adapter": runners["webgpu"].llm.backend.describe()["name"],
           "host": host_share(runners["webgpu"], args.reps), "prompt": prompt_share(runners["webgpu"], args.reps),
           "llama_cpp_variant": variant}
    if gpu_peer:
        out["llama_gpu_build"] = {k: gpu_peer[k] for k in ("backend", "device", "build")}
    for key, s in samples.items():
        if s["pp"]:
            out[key] = {"pp_tps": statistics.median(s["pp"]), "tg_tps": statistics.median(s["tg"]), **s}
    for runner in runners.values():  # before the many-stream run loads the model again
        runner.llm.close()
    if args.many:
        out["many"] = many_block(spec, path, args, peer_many)
    return out


def many_block(spec: str, path: Path, args, peer_many: dict) -> dict:
    """ember's --many streams run on the model, and llama-batched-bench's where it ran."""
    out = {"webgpu": guarded(f"webgpu, {args.many} streams", many_streams, path, args.device, args.many,
                             args.n_prompt, args.n_gen)}
    if spec in peer_many:
        out[GPU_PEER] = peer_many[spec]
    return out


def guarded(what: str, fn, *args) -> dict:
    """fn(*args), or its error: one failure must not cost the run's other figures."""
    try:
        return fn(*args)
    except Exception as e:
        print(f"  {what}: {type(e).__name__}: {e}", file=sys.stderr)
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


def peer_many_streams(args) -> dict:
    """llama-batched-bench of --llama-bin on each model, N streams (--many), run before ember has
    opened the adapter in this process: run after ember's models, its prompts came out 20-90x
    slower than on their own (likely its fitting of buffers to the device memory it finds free,
    on by default, while ember's buffers were still held). Batches of 2048 tokens computed 512 and
    2048 at a time (-ub), the faster counted (peer.batched_best)."""
    return {spec: guarded(f"{GPU_PEER}, {args.many} streams", peer.batched_best, args.llama_bin, model_path(spec),
                          True, args.many, args.n_prompt, args.n_gen) for spec in args.models}


def many_streams(path: Path, device: str, n_streams: int, n_prompt: int, n_gen: int) -> dict:
    """n_streams requests of n_prompt random tokens generating n_gen each, all submitted at once
    and read by one asyncio loop (as the server reads them); total tokens/s (prompt and generated)
    over the whole run. The same run once before, untimed: the step shapes it meets are recorded then."""
    import asyncio

    from ember.engine import Request, TokenEvent

    rng = np.random.default_rng(1)
    # steps of up to 2048 tokens, as llama-batched-bench's batches (-b, -ub)
    with LLM(str(path), device=device, slots=n_streams, ctx=n_prompt + n_gen + 8, batch=2048) as llm:
        vocab = min(llm.model.n_vocab, 32000)

        async def one(prompt: list) -> int:
            got = 0
            async for ev in llm.engine.submit_async(Request(prompt, n_gen, GREEDY)):
                got += isinstance(ev, TokenEvent)
            return got

        async def run_all(prompts: list) -> list:
            return await asyncio.gather(*(one(p) for p in prompts))

        runs = []
        for _ in range(2):
            prompts = [rng.integers(0, vocab, n_prompt).tolist() for _ in range(n_streams)]
            timer = _cuda_bench().StepTimer(llm.engine)  # the engine's steps timed (generic, not CUDA's own)
            runner, kinds = llm.engine.runner, []
            launch = runner.launch

            def launch_noted(plan, *a, **kw):  # each step's sequences, and whether its shape was recorded then
                out = launch(plan, *a, **kw)
                kinds.append((len(plan.chunks), runner.recorded))
                return out

            runner.launch = launch_noted
            t0 = time.perf_counter()
            generated = sum(asyncio.run(run_all(prompts)))
            wall = time.perf_counter() - t0
            runner.launch = launch  # the timer's, which it removes
            timer.remove()
            steps = [(k, round(1e3 * st, 2), round(1e3 * rt, 2), c, r)
                     for (k, st, rt), (c, r) in zip(timer.steps, kinds)]
            runs.append({"total_tps": (n_prompt * n_streams + generated) / wall, "generated": generated,
                         "wall_s": wall, "phases": timer.phases(), "decode_steps": timer.summary(n_streams),
                         "steps": steps})  # (tokens, step ms, launch and wait ms, sequences, recorded then)
        profile = many_profile(llm, n_streams)
    return {"streams": n_streams, **runs[-1], "first_run": runs[0], "profile": profile}


def many_profile(llm, n_streams: int) -> dict:
    """The many-stream run's recorded steps of all streams decoding (n_streams rows) and of a full
    batch of prompt tokens (2048): the adapter's time for the step's one pass and each dispatch
    timed alone, summed by kernel (needs timestamp queries)."""
    backend, runner = llm.backend, llm.engine.runner
    if "timestamp-query" not in backend.device.features:
        return {}
    out = {}
    for what, store, n in (("decode", runner._recordings, n_streams), ("prompt", runner._large, 2048)):
        rec = next((v[0] for k, v in store.items() if k[0] == n), None)
        if rec is not None:
            out[what] = {"tokens": n, "dispatches": len(rec.dispatches), "gpu_ms": gpu_ms(backend, rec, 3),
                         "kernels": kernel_profile(backend, rec, 3)}
    return out


@functools.cache
def _cuda_bench():
    """bench/cuda.py by path (its StepTimer), loaded once: a module named `cuda` on sys.path would
    shadow NVIDIA's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ember_bench_cuda", Path(__file__).resolve().parent / "cuda.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def llama_gpu_bench(bin_dir: Path, path: Path, n_prompt: int, n_gen: int) -> dict:
    """One llama-bench run of a GPU build of llama.cpp (all layers on the GPU, flash attention on),
    and which backend and device it ran on: a build that finds no GPU runs on the CPU."""
    args = [str(bin_dir / "llama-bench"), "-m", str(path), "-p", str(n_prompt), "-n", str(n_gen), "-r", "1",
            "-ngl", "99", "-fa", "1", "-o", "json"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench exited {proc.returncode}: {proc.stderr[-800:]}")
    rows = json.loads(proc.stdout)
    out = {"backend": rows[0].get("backends"), "device": rows[0].get("gpu_info"), "build": rows[0].get("build_commit"),
           "pp_samples": [], "tg_samples": []}
    for row in rows:
        out["tg_samples" if row["n_gen"] else "pp_samples"] += row["samples_ts"]
    if not out["device"] or out["backend"] in (None, "", "CPU"):
        raise RuntimeError(f"llama-bench ran on {out['backend']!r}, not a GPU: {proc.stderr[-800:]}")
    return out


LAYER_PRODUCTS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))


def layer_products(backend, path: Path, n: int) -> list:
    """(weights, x, outs, flops) of the first layer's products, the weights on the device."""
    from ember.gguf_loader import GGUFFile

    rng = np.random.default_rng(3)
    found = []
    with GGUFFile(path) as f:
        for names in LAYER_PRODUCTS:
            ws = [backend.weight(f.tensors[f"blk.0.{name}.weight"]) for name in names]
            x = backend.from_numpy(rng.standard_normal((n, ws[0].shape[1])).astype(np.float32))
            outs = [backend.empty((n, w.shape[0])) for w in ws]
            found.append((ws, x, outs, sum(2 * n * w.shape[0] * w.shape[1] for w in ws)))
        backend.settle()  # the weights copied to the device while the file is open
    return found


def old_mm(backend, decoder: str, rev: str):
    """The `mm` pipeline of git revision rev's matmul.wgsl (or of the file rev names) in this
    tree's module of a weight type (named by its decoder)."""
    from ember.backends.webgpu import _kernels

    named = {"PIECE(": decoder.replace("deq_", "pc_") + "(", "DEQ(": f"{decoder}("}

    def resolved(text: str) -> str:
        for a, b in named.items():
            text = text.replace(a, b)
        return text

    if Path(rev).is_file():  # a copy (a machine without the repository's history)
        old = Path(rev).read_text()
    else:
        old = subprocess.run(["git", "show", f"{rev}:ember/backends/webgpu/kernels/matmul.wgsl"], check=True,
                             capture_output=True, text=True, cwd=Path(__file__).resolve().parent).stdout
    code = _kernels._products(decoder).replace(resolved(_kernels.source("matmul.wgsl")), resolved(old))
    module = backend.device.create_shader_module(code=code)
    return backend.device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "mm"})


def product_steps(backend, products, rev: str, old_tile: int) -> tuple:
    """Recorded steps of the products: this tree's mm, rev's (its own workgroup grid) and mv_row;
    and the dispatches of each product (a group of matrices of two types takes two)."""
    from ember.backends.webgpu._step import Dispatch

    backend.row_products = False  # the GPU plan on any adapter
    spans = []
    with backend.record() as new:
        for ws, x, outs, _ in products:
            start = len(new.dispatches)
            backend.matmuls(ws, x, outs)
            spans.append(range(start, len(new.dispatches)))
    names, pipes = backend.kernels.names(), {}
    with backend.record() as old:
        for d in new.dispatches:
            decoder = names[id(d.pipeline)][0]
            pipe = pipes.get(decoder) or pipes.setdefault(decoder, old_mm(backend, decoder, rev))
            rows, n = int(d.params[0]), int(d.params[2])
            old.dispatches.append(Dispatch(pipe, d.bindings, d.params, (-(-rows // old_tile), -(-n // old_tile), 1)))
    with backend.record() as by_rows:  # the CPU adapters' kernel for a few rows
        for d in new.dispatches:
            rows, n = int(d.params[0]), int(d.params[2])
            pipe = backend.kernels.pipeline(names[id(d.pipeline)][0], "mv_row")
            by_rows.dispatches.append(Dispatch(pipe, d.bindings, d.params, (-(-rows // 64), -(-n // 8), 1)))
    return {"new": new, "old": old, "mv_row": by_rows}, spans


def bench_products(spec: str, args) -> dict:
    path = model_path(spec)
    from ember.backends import get_backend

    backend = get_backend(args.device)
    if "timestamp-query" not in backend.device.features:
        raise SystemExit("--products needs an adapter with timestamp queries")
    products = layer_products(backend, path, args.n_prompt)
    steps, spans = product_steps(backend, products, args.products, args.products_tile)
    times = {key: [] for key in steps}
    for _ in range(args.reps):
        for key, step in steps.items():
            times[key].append(step.gpu_times(backend.device, backend.wgpu))
    out = {"path": str(path), "adapter": backend.describe()["name"], "n": args.n_prompt, "against": args.products,
           "products": []}
    for (ws, _, _, flops), span in zip(products, spans):
        row = {"weights": [f"{w.name.split('.')[2]} {w.type.name} {w.shape[0]}x{w.shape[1]}" for w in ws],
               "gflop": flops / 1e9}
        for key in steps:
            each = [sum(float(t[i]) for i in span) for t in times[key]]
            ns = statistics.median(each)
            row[key] = {"ms": ns / 1e6, "gflops": flops / ns, "samples_ms": [e / 1e6 for e in each]}
        out["products"].append(row)
    return out


LANES = (32, 64, 128)
# (lanes, weight rows, teams) of mvq's team builds
TEAMS = ((32, 2, 2), (32, 2, 4), (32, 2, 8), (64, 2, 2), (64, 2, 4), (32, 4, 4), (64, 4, 2), (16, 2, 16), (8, 2, 32))


def bench_lanes(spec: str, args) -> dict:
    """The decode kernel (one activation row) with 32, 64 and 128 lanes a workgroup on the first
    layer's products and the output head: each dispatch timed alone, the builds alternating;
    medians, us and GB/s of the weights. A type with its own decode entry (Q4_K's and Q6_K's mvk)
    is timed beside the piece kernel (mvp) it replaced; mvq also at 4 weight rows a workgroup (r4)."""
    from ember.backends import get_backend
    from ember.backends.webgpu import MATRIX_TYPES, MV_ROWS, _groups
    from ember.backends.webgpu._kernels import MV_OWN, mv_build
    from ember.backends.webgpu._step import Dispatch, Step
    from ember.gguf_loader import GGUFFile

    path = model_path(spec)
    backend = get_backend(args.device)
    if "timestamp-query" not in backend.device.features:
        raise SystemExit("--lanes needs an adapter with timestamp queries")
    backend.row_products = False  # the GPU plan on any adapter
    with GGUFFile(path) as f:
        head = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"
        names = [f"blk.0.{n}.weight" for group in LAYER_PRODUCTS for n in group] + [head]
        ws = [backend.weight(f.tensors[n]) for n in names if n in f.tensors]
        backend.settle()
    sums = "sg" if backend.subgroups else "wg"
    out = {"path": str(path), "adapter": backend.describe()["name"], "products": []}
    for w in ws:
        x = backend.from_numpy(np.random.default_rng(0).standard_normal((1, w.shape[1])).astype(np.float32))
        recs, served_min_k = {}, backend.int8_min_k
        backend.int8_min_k = 0  # mvq at every width, whatever the served threshold
        for int8 in (False, True):  # the f32 products, then x as int8 blocks and mvq
            backend.int8_products = int8
            with backend.record() as recs[int8]:
                backend.matmul(w, x, backend.empty((1, w.shape[0])))
        backend.int8_products, backend.int8_min_k = True, served_min_k
        names = backend.kernels.names()
        rec = recs[False]
        quant = [d for d in recs[True].dispatches if names[id(d.pipeline)][1] == "quant_q8"]
        served = names[id(rec.dispatches[0].pipeline)][1]
        steps = {}
        if quant:  # quant_q8 alone, then mvq on its blocks
            step = Step(record=True)
            step.dispatches = quant
            step.build(backend.device, backend.wgpu)
            steps["quant_q8"] = step
        own = ("mvk",) if MATRIX_TYPES[w.type] in MV_OWN else ()
        for entry in dict.fromkeys(("mvq",) * bool(quant) + own + (served, "mvp")):
            ds = [d for d in recs[True].dispatches if d not in quant] if entry == "mvq" else rec.dispatches
            builds = [(lanes, MV_ROWS, 1) for lanes in LANES]
            if entry == "mvq":
                builds += [(32, 4, 1)] + [(lanes, nr, teams) for lanes, nr, teams in TEAMS]
            for lanes, nr, teams in builds:  # nr: weight rows a team (MV_ROWS served, 4 the r4 build)
                module = f"{MATRIX_TYPES[w.type]}+mv1+{sums}" + mv_build(lanes, teams, nr)
                step = Step(record=True)
                step.dispatches = [Dispatch(backend.kernels.pipeline(module, entry),
                                            d.bindings if entry == "mvq" else _rebind(d.bindings, entry, MATRIX_TYPES[w.type]),
                                            d.params, _groups(-(-int(d.params[0]) // (nr * teams))))
                                   for d in ds]
                step.build(backend.device, backend.wgpu)
                steps[f"{entry}/{lanes}" + (f"/r{nr}" if nr != MV_ROWS else "") + (f"/t{teams}" if teams > 1 else "")] = step
        times = {key: [] for key in steps}
        for _ in range(max(args.reps, 5)):
            for key, step in steps.items():
                times[key].append(float(np.sum(step.gpu_times(backend.device, backend.wgpu))) / 1e3)
        nbytes = w.data.row_bytes * w.shape[0]
        out["products"].append({"weight": f"{w.name} {w.type.name} {w.shape[0]}x{w.shape[1]}", "mb": nbytes / 1e6,
                                "us": {key: statistics.median(v) for key, v in times.items()}})
    return out


def _rebind(bindings: tuple, entry: str, decoder: str) -> tuple:
    """A product's bindings for `entry`: mvp reads the weights at binding 1, mvk at its type's."""
    from ember.backends.webgpu._kernels import MV_OWN

    to = 1 if entry == "mvp" else MV_OWN[decoder][1]
    weights = {1} | {binding for _, binding in MV_OWN.values()}  # where a recorded product has them
    return tuple(sorted((to if b in weights else b, buf) for b, buf in bindings))


def report_lanes(name: str, r: dict) -> None:
    print(f"{name} on {r['adapter']}: the decode kernel at one row, us (GB/s of the weights), entry/lanes a workgroup")
    for p in r["products"]:
        cells = "  ".join(f"{key} {us:8.1f} ({p['mb'] * 1e3 / us:6.1f})" for key, us in p["us"].items())
        print(f"  {p['weight']:44s} {p['mb']:7.2f} MB  {cells}")


def report_products(name: str, r: dict) -> None:
    print(f"{name} on {r['adapter']}: a layer's prompt products at n = {r['n']}, ms (GFLOP/s): "
          f"this tree's mm / {r['against']}'s mm / mv_row")
    total = dict.fromkeys(("new", "old", "mv_row"), 0.0)
    for row in r["products"]:
        for key in total:
            total[key] += row[key]["ms"]
        times = " / ".join(f"{row[key]['ms']:7.2f} ({row[key]['gflops']:5.1f})" for key in total)
        print(f"  {' + '.join(row['weights']):50s} {times}")
    print(f"  layer: {' / '.join(f'{v:.2f}' for v in total.values())} ms; this tree's mm "
          f"{total['old'] / total['new']:.2f}x {r['against']}'s, {total['mv_row'] / total['new']:.2f}x mv_row")


def report(name: str, r: dict, args) -> None:
    print(f"{name} on {r.get('adapter', args.device)}: pp{args.n_prompt} / tg{args.n_gen} tok/s")
    for key in (*(k for k in r if k.startswith("webgpu")), "cpu", "llama.cpp", GPU_PEER):
        if key in r and isinstance(r[key], dict) and "pp_tps" in r[key]:
            print(f"  {key:17s} {r[key]['pp_tps']:9.1f} {r[key]['tg_tps']:8.2f}")
    if GPU_PEER in r:
        g = r["llama_gpu_build"]
        print(f"  webgpu / {GPU_PEER} ({g['backend']}, {g['device']}, build {g['build']}): "
              f"pp {r['webgpu']['pp_tps'] / r[GPU_PEER]['pp_tps']:.2f}x, "
              f"tg {r['webgpu']['tg_tps'] / r[GPU_PEER]['tg_tps']:.2f}x")
    many = r.get("many", {})
    if "total_tps" in many.get("webgpu", {}):
        peer_tps = many.get(GPU_PEER, {}).get("total_tps")
        w = many["webgpu"]
        print(f"  {w['streams']} x ({args.n_prompt} + {args.n_gen}) at once, total tok/s: webgpu "
              f"{w['total_tps']:.0f}" + (f", {GPU_PEER} {peer_tps:.0f} ({w['total_tps'] / peer_tps:.2f}x)"
                                         if peer_tps else ""))
        print(f"    webgpu's steps: {w['phases']}; all streams decoding: {w['decode_steps']}")
        for what, prof in w.get("profile", {}).items():
            print(f"    a {what} step of {prof['tokens']} tokens: GPU {prof['gpu_ms']:.2f} ms, {prof['dispatches']} "
                  f"dispatches; timed alone: " + ", ".join(f"{k['kernel']} {k['dispatches']} x {k['ms']:.2f} ms"
                                                           for k in prof["kernels"][:8]))
    if "host" not in r:  # --many-only
        return
    h = r["host"]
    gpu = f"{h['gpu_ms']:.2f} ms" if h["gpu_ms"] is not None else "not timed (no timestamp queries)"
    print(f"  decode step: {h['dispatches']} dispatches encoded by {h['encoder']}, host {h['host_ms']:.3f} ms "
          f"(min {h['host_ms_min']:.3f}; {h['host_us_per_dispatch']:.1f} us a dispatch), GPU {gpu}, "
          f"wait for the ids {h['wait_ms']:.2f} ms, "
          f"whole step in tg {1e3 / r['webgpu']['tg_tps']:.2f} ms")
    if h.get("submit_ms") is not None:
        end = f"{h['gpu_ms_end']:.2f} ms" if h["gpu_ms_end"] is not None else "not timed"
        print(f"  tg{args.n_gen}'s steps: submit to submit {h['submit_ms']:.3f} ms (p90 {h['submit_ms_p90']:.3f}; "
              f"{h['steps_replayed']} replays), GPU of its last step {end}")
    for what, h in (("decode", h), (f"pp{args.n_prompt}", r["prompt"])):
        if what != "decode":
            gpu = f"{h['gpu_ms']:.2f} ms" if h["gpu_ms"] is not None else "not timed"
            print(f"  {what} step: {h['dispatches']} dispatches, host {h['host_ms']:.3f} ms, GPU {gpu}, "
                  f"wait {h['wait_ms']:.2f} ms")
        if h["kernels"]:
            total = sum(k["ms"] for k in h["kernels"])
            print(f"  {what} step's dispatches timed alone: {total:.2f} ms in all "
                  f"(the step's one pass: {h['gpu_ms']:.2f} ms)")
            for k in h["kernels"][:12]:
                print(f"    {k['kernel']:40s} {k['dispatches']:4d} x  {k['ms']:7.3f} ms  {100 * k['ms'] / total:5.1f}%")
            print(f"  {what} step's longest dispatches (params 0-3, workgroups):")
            for d in h["largest"]:
                print(f"    {d['kernel']:40s} {d['us']:9.1f} us  {d['params']}  {d['groups']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--device", default="webgpu", help="the WebGPU adapter (webgpu or webgpu:N)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of ember's CPU backend and llama.cpp")
    ap.add_argument("--n-prompt", type=int, default=64)
    ap.add_argument("--n-gen", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "webgpu.json")
    ap.add_argument("--products", metavar="REV",
                    help="time the prompt products alone, beside the mm of git revision REV (or of the matmul.wgsl "
                    "at path REV)")
    ap.add_argument("--products-tile", type=int, default=32, help="the output tile of REV's mm")
    ap.add_argument("--attention-ab", action="store_true",
                    help="also runners with the other prompt-attention kernels (attn_flash, the row kernel "
                    "attention, attn_tile)")
    ap.add_argument("--no-cpu", action="store_true",
                    help="leave out the CPU runs, ember's and llama.cpp's (large files, where they would take "
                    "minutes a rep)")
    ap.add_argument("--llama-bin", type=Path, default=None, metavar="DIR",
                    help="llama-bench of a GPU build of llama.cpp (Vulkan: bench/webgpu_device_run.sh's vulkan "
                    "stage carries or builds it) run beside ember in each rep, all layers on the GPU, flash attention on")
    ap.add_argument("--many", type=int, default=0, metavar="N",
                    help="also N streams of --n-prompt + --n-gen tokens at once through the engine, total tokens/s "
                    "(and --llama-bin's llama-batched-bench -npl N)")
    ap.add_argument("--many-only", action="store_true", help="with --many: that run alone, no pp/tg runs")
    ap.add_argument("--lanes", action="store_true",
                    help="time the decode kernel alone with 32, 64 and 128 lanes a workgroup instead")
    ap.add_argument("--checks", default="served", metavar="BITS",
                    help="naga's runtime checks compiled into the kernels: served (ember's choice), wgpu (wgpu's "
                    "default, all of them) or the ShaderRuntimeChecks bits (1 index clamps, 2 loop counters)")
    args = ap.parse_args()
    if args.checks != "served":
        from ember.backends.webgpu import _kernels

        _kernels.RUNTIME_CHECKS = None if args.checks == "wgpu" else int(args.checks)
    results = {"cpu": cpu_name(), "load_before": machine_load(), "n_prompt": args.n_prompt, "n_gen": args.n_gen,
               "threads": args.threads, "checks": args.checks, "models": {}}
    peer_many = peer_many_streams(args) if args.many and args.llama_bin and not (args.lanes or args.products) else {}
    for spec in args.models:
        name = spec.partition("=")[0]
        if args.lanes:
            results["models"][name] = r = bench_lanes(spec, args)
            report_lanes(name, r)
        elif args.products:
            results["models"][name] = r = bench_products(spec, args)
            report_products(name, r)
        else:
            results["models"][name] = r = bench_model(spec, args, peer_many)
            report(name, r, args)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))  # after each model: a cut-short run keeps the others
    results["load_after"] = machine_load()
    args.out.write_text(json.dumps(results, indent=2))
    print(f"load average {results['load_before']['loadavg'][0]:.2f} before, "
          f"{results['load_after']['loadavg'][0]:.2f} after; wrote {args.out}")


if __name__ == "__main__":
    main()
