"""CUDA speed on the GPU machine, through the engine (what a user gets), beside llama.cpp's numbers.

For each model: pp512 (one 512-token prompt) and tg128 (128 tokens, one stream), as llama-bench
defines them; 64 concurrent streams of 512 prompt + 128 generated tokens (llama-batched-bench's
total rate); the same 64 streams sharing one 512-token prompt (served by the prefix cache; the
generation rate). Then, on ~1.5 B llama-shaped synthetic models (Q4_K, Q8_0), the batch-1 decode
step's weight bandwidth against a measured device copy; and cold start: process start to first
token with an empty kernel cache, then again with the cache on disk.

No llama.cpp CUDA build runs here: the peer figures are the issue's table (llama.cpp 0c1e570,
sm_90, on the same H200 kind, same-shaped models). Writes JSON (--out).

    python bench/cuda.py --models smollm2=PATH gemma3-270m=PATH [--quick] [--out cuda.json]
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# this file is named cuda.py: its own folder must not shadow NVIDIA's `cuda` package that CuPy imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from ember.engine import LLM, Request, TokenEvent
from ember.sampler import SamplingParams

PEERS = {  # llama.cpp on the H200 (the table), tokens/s
    "smollm2": {"pp512": 57500, "tg128": 936, "batched_total": 27000, "shared_gen": 10800},
    "gemma3-270m": {"pp512": 65000, "tg128": 996, "batched_total": 32200, "shared_gen": 10400},
}
GOALS = {"pp512": 1.0, "tg128": 1.5, "batched_total": 1.5, "shared_gen": 1.5}
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


# ---- single stream ----

def single_stream(path: str, reps: int, n_prompt: int = 512, n_gen: int = 128) -> dict:
    rng = np.random.default_rng(0)
    with LLM(path, device="cuda", slots=1, ctx=n_prompt + n_gen + 8, prefix_cache=False) as llm:
        v = llm.model.n_vocab
        llm.generate(rng.integers(0, v, n_prompt).tolist(), 4, GREEDY)  # warm-up: kernels, recordings
        llm.generate([int(rng.integers(v))], 8, GREEDY)
        pp = []
        for _ in range(reps):
            c = llm.generate(rng.integers(0, v, n_prompt).tolist(), 1, GREEDY)
            pp.append(n_prompt / c.timings.prompt_s)
        tg = []
        for _ in range(reps):
            c = llm.generate([int(rng.integers(v))], n_gen + 1, GREEDY)
            tg.append(c.timings.generation_tps)
        step_ms = replay_step_ms(llm)
        profile = step_profile(llm)
        return {"pp512": statistics.median(pp), "tg128": statistics.median(tg), "pp_samples": pp, "tg_samples": tg,
                "graph_step_ms": step_ms, "load_s": llm.load_s, **backend_info(llm), "profile": profile}


def prefill_only(path: str, reps: int, n_prompt: int = 512) -> dict:
    """pp512 alone, and the prompt step's kernels each timed alone (for A/B variants)."""
    rng = np.random.default_rng(0)
    with LLM(path, device="cuda", slots=1, ctx=n_prompt + 16, prefix_cache=False) as llm:
        v = llm.model.n_vocab
        llm.generate(rng.integers(0, v, n_prompt).tolist(), 1, GREEDY)
        pp = [n_prompt / llm.generate(rng.integers(0, v, n_prompt).tolist(), 1, GREEDY).timings.prompt_s
              for _ in range(reps)]
        return {"pp512": statistics.median(pp), "pp_samples": pp, "profile": prompt_profile(llm, n_prompt)}


def prompt_profile(llm, n_prompt: int) -> dict:
    runner = llm.engine.runner
    recs = [rec for key, (rec, _) in runner._large.items() if key[0] == n_prompt]
    return launch_profile(llm.model.backend, recs[0]) if recs else {}


def graph_us(cp, launches, reps: int = 40) -> float:
    """Microseconds per pass over `launches`, `reps` passes captured in one CUDA graph (in-graph
    launch gaps included, as in a recorded step)."""
    for launch in launches:  # warm-up (and compile)
        launch.run()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for _ in range(reps):
            for launch in launches:
                launch.run()
        graph = stream.end_capture()
    times = []
    for _ in range(5):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        graph.launch(stream)
        e1.record(stream)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) * 1000 / reps)
    return statistics.median(times)


def step_profile(llm, tokens: int = 1) -> dict:
    runner = llm.engine.runner
    recs = [rec for key, (rec, _) in runner._recordings.items() if key[0] == tokens and key[1] == tokens]
    return launch_profile(llm.model.backend, recs[0]) if recs else {}


def launch_profile(backend, rec) -> dict:
    """Each kernel of a recorded step timed alone (graph-replayed): per kernel name,
    [launches, total us]; their sum beside the whole step's replay."""
    by_name: dict = {}
    for launch in rec.launches:
        if not hasattr(launch, "fn"):  # host<->device copies
            continue
        us = graph_us(backend.cp, [launch], reps=20)
        entry = by_name.setdefault(backend.kernels.name_of(launch.fn), [0, 0.0])
        entry[0] += 1
        entry[1] = round(entry[1] + us, 2)
    total = round(sum(v[1] for v in by_name.values()), 1)
    return {"sum_us": total, "kernels": dict(sorted(by_name.items(), key=lambda kv: -kv[1][1]))}


def with_engine(changes: dict, fn, *args):
    """fn(*args) with every LLM it makes given these engine options (decode_ahead=False: decode
    steps one after the other, the baseline of the engine's decode-ahead)."""
    global LLM
    real = LLM
    LLM = functools.partial(real, **changes)
    try:
        return fn(*args)
    finally:
        LLM = real


def with_config(changes: dict, fn, *args):
    """fn(*args) with every CUDA backend it makes (through LLM or get_backend) on a CudaConfig
    of these changes: the backend's variants, which the benchmark compares with the default."""
    import ember.backends as backends
    import ember.engine.llm as llm_module
    from ember.backends.cuda import CudaConfig

    real = backends.get_backend
    patched = functools.partial(real, config=CudaConfig(**changes))
    backends.get_backend = llm_module.get_backend = patched
    try:
        return fn(*args)
    finally:
        backends.get_backend = llm_module.get_backend = real


ENGINE_OPTIONS = {"decode_ahead"}  # variant keys given to LLM; the others are CudaConfig fields


def variant(changes: dict, fn, *args):
    """fn(*args) with a variant's engine options and CudaConfig changes."""
    engine = {k: v for k, v in changes.items() if k in ENGINE_OPTIONS}
    cuda = {k: v for k, v in changes.items() if k not in ENGINE_OPTIONS}
    return with_engine(engine, with_config, cuda, fn, *args)


def decode_only(path: str, reps: int, n_gen: int = 128) -> dict:
    """tg and the recorded step's replay time alone (for A/B variants)."""
    rng = np.random.default_rng(0)
    with LLM(path, device="cuda", slots=1, ctx=n_gen + 16, prefix_cache=False) as llm:
        v = llm.model.n_vocab
        llm.generate([int(rng.integers(v))], 8, GREEDY)
        tg = [llm.generate([int(rng.integers(v))], n_gen + 1, GREEDY).timings.generation_tps for _ in range(reps)]
        return {"tg128": statistics.median(tg), "graph_step_ms": replay_step_ms(llm),
                "launches_per_replay": backend_info(llm)["launches_per_replay"]}


def replay_step_ms(llm, n: int = 200, tokens: int = 1) -> float | None:
    """Median time of one recorded step of `tokens` tokens replayed alone: the GPU's share."""
    runner, backend = llm.engine.runner, llm.model.backend
    # steps of `tokens` sequences of one token each (a recorded prompt chunk of as many tokens
    # would read page-table rows the current inputs do not have)
    recs = [rec for key, (rec, _) in runner._recordings.items() if key[0] == tokens and key[1] == tokens]
    if not recs:
        return None
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        backend.replay(recs[0])
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def backend_info(llm) -> dict:
    b = llm.model.backend
    recs = list(llm.engine.runner._recordings.values())
    return {"graph_error": b.graph_error, "graphs": b.graphs, "fuse": b.fuse, "pdl_error": b.pdl_error,
            "ops_per_recorded_step": [len(r.ops) for r, _ in recs][:4],
            "launches_per_replay": [len(r.launches) for r, _ in recs][:4]}


# ---- many streams ----

def many_streams(path: str, n_streams: int, n_prompt: int, n_gen: int, shared: bool, consumer: str = "async") -> dict:
    """n_streams requests of n_prompt tokens generating n_gen each, all submitted at once. The
    streams are read as the HTTP server reads them (consumer "async": one asyncio loop in one
    thread), or by a thread each ("threads": llm.stream in n_streams threads, whose wake-ups
    compete with the engine's thread for the interpreter)."""
    rng = np.random.default_rng(1)
    with LLM(path, device="cuda", slots=n_streams, ctx=n_prompt + n_gen + 8, batch=2048) as llm:
        v = llm.model.n_vocab
        llm.generate(rng.integers(0, v, 64).tolist(), 4, GREEDY)  # warm-up
        base = rng.integers(0, v, n_prompt).tolist()
        prompts = [base if shared else rng.integers(0, v, n_prompt).tolist() for _ in range(n_streams)]
        firsts, ends, counts = [0.0] * n_streams, [0.0] * n_streams, [0] * n_streams

        def got_token(i: int) -> None:
            counts[i] += 1
            if counts[i] == 1:
                firsts[i] = time.perf_counter()

        def run(i: int) -> None:
            for _ in llm.stream(prompts[i], n_gen, GREEDY, logprobs=False):
                got_token(i)
            ends[i] = time.perf_counter()

        async def run_async(i: int) -> None:
            async for ev in llm.engine.submit_async(Request(prompts[i], n_gen, GREEDY)):
                if isinstance(ev, TokenEvent):
                    got_token(i)
            ends[i] = time.perf_counter()

        async def run_all() -> None:
            await asyncio.gather(*(run_async(i) for i in range(n_streams)))

        runner = llm.engine.runner
        shapes0 = len(runner._recordings) + len(runner._large)
        timer = StepTimer(llm.engine)
        t0 = time.perf_counter()
        if consumer == "async":
            asyncio.run(run_all())
        else:
            with ThreadPoolExecutor(n_streams) as pool:
                for f in [pool.submit(run, i) for i in range(n_streams)]:
                    f.result()
        t_end = max(ends)
        timer.remove()
        shapes = len(runner._recordings) + len(runner._large) - shapes0
        generated = sum(counts)
        prefill_end = max(firsts)
        computed = n_prompt if shared else n_prompt * n_streams
        return {"streams": n_streams, "generated": generated, "wall_s": t_end - t0,
                "total_tps": (n_prompt * n_streams + generated) / (t_end - t0),
                "gen_tps": (generated - n_streams) / max(t_end - prefill_end, 1e-9),
                "gen_tps_whole_run": generated / (t_end - t0),
                "prompt_tokens_computed": llm.engine.metrics.prompt_tokens_computed, "expected_computed": computed,
                "decode_steps": timer.summary(n_streams), "decode_replay_ms": replay_step_ms(llm, 50, n_streams),
                "phases": timer.phases(), "shapes_recorded": shapes,
                "decode_profile": step_profile(llm, n_streams) if shared else {}}


class StepTimer:
    """Wall time of the engine's steps and of the runner inside them (launch and wait for the
    device), for steps of exactly n tokens (all streams decoding): what a decode step costs
    beside the GPU's replay alone."""

    def __init__(self, engine):
        self.engine, self.runner = engine, engine.runner
        self.steps: list = []  # (tokens, step seconds, runner seconds)
        self._launch, self._wait, self._step = self.runner.launch, self.runner.wait, engine.step
        self._last = None  # [tokens, runner seconds] of the step under way

        def launch(plan, top_k=0, ahead=None):
            t = time.perf_counter()
            try:
                return self._launch(plan, top_k, ahead)
            finally:
                self._last = [sum(c.n for c in plan.chunks), time.perf_counter() - t]

        def wait(step):
            t = time.perf_counter()
            try:
                return self._wait(step)
            finally:
                if self._last is not None:
                    self._last[1] += time.perf_counter() - t

        def step():
            t = time.perf_counter()
            self._last = None
            self._step()
            if self._last is not None:
                self.steps.append((self._last[0], time.perf_counter() - t, self._last[1]))

        self.runner.launch, self.runner.wait, engine.step = launch, wait, step

    def remove(self) -> None:
        del self.runner.launch, self.runner.wait, self.engine.step

    def phases(self) -> dict:
        """Every step's wall time, as totals of prompt-sized steps (more than 64 tokens) and
        small ones, and the slowest few (tokens, ms): where a run's time goes."""
        big = [s for k, s, _ in self.steps if k > 64]
        small = [s for k, s, _ in self.steps if k <= 64]
        slow = sorted(((round(1000 * s, 1), k) for k, s, _ in self.steps), reverse=True)[:8]
        return {"prompt_steps": len(big), "prompt_ms": round(1000 * sum(big), 1), "small_steps": len(small),
                "small_ms": round(1000 * sum(small), 1), "slowest_ms_tokens": slow}

    def summary(self, n: int) -> dict:
        runner_ms = sorted(1000 * r for k, _, r in self.steps if k == n)
        step_ms = sorted(1000 * s for k, s, _ in self.steps if k == n)
        if not step_ms:
            return {}
        return {"steps": len(step_ms), "step_ms_p50": step_ms[len(step_ms) // 2],
                "runner_ms_p50": runner_ms[len(runner_ms) // 2], "step_ms_sum": sum(step_ms),
                "runner_ms_sum": sum(runner_ms)}


# ---- 1.5 B roofline ----

def copy_bandwidth(cp, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy, bytes read plus written per second (GB/s)."""
    a = cp.random.random(nbytes // 4, dtype=cp.float32)
    b = cp.empty_like(a)
    b[...] = a
    times = []
    for _ in range(reps):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        b[...] = a
        e1.record()
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) / 1000)
    return 2 * a.nbytes / statistics.median(times) / 1e9


# single-stream decode with one setting changed: (label, engine option or CudaConfig changes)
DECODE_VARIANTS = [
    ("decode_ahead_0", {"decode_ahead": False}),
    ("decode_pdl_0", {"pdl": False}),
    ("decode_fuse_0", {"fuse": False}),
    ("decode_prologue_k_0", {"prologue_k": 0}),  # every norm a quant_x launch of its own
    ("decode_att_waves_8", {"att_waves": 8}),
]

# the 1.5 B decode step with one setting changed
ROOFLINE_VARIANTS = [
    ("prologue_k_1024", {"prologue_k": 1024}),
    ("att_waves_1", {"att_waves": 1}),
]

LLAMA_1_5B = {"n_layer": 28, "d_model": 1536, "d_ff": 8960, "n_head": 12, "n_kv_head": 2, "head_dim": 128, "n_vocab": 151936}


def q4_k_m_type(name: str, layer: int, n_layer: int) -> str:
    """The type llama.cpp's Q4_K_M mix gives a llama tensor: Q6_K for the output head, and for
    attn_v and ffn_down on the layers it gives more bits (the first and last eighth, and every
    third between), Q4_K for the rest."""
    more = layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2
    if name == "output" or (name in ("attn_v", "ffn_down") and more):
        return "Q6_K"
    return "Q4_K"


def write_big_model(path: Path, qtype_name: str, shape: dict, metadata=None) -> int:
    """A llama-shaped GGUF with random blocks of one type (valid small scales), or of the Q4_K_M
    mix (qtype_name "Q4_K_M": q4_k_m_type, with an output head of its own); returns the bytes of
    the matrices one decode step reads (every layer matrix and the output head, the tied
    embedding where there is none). metadata(writer): adds keys (a vocabulary, say)."""
    import gguf

    from ember.quant import GGMLType, layout

    scale_fields = {GGMLType.Q4_K: ((0, 0.002), (2, 0.001)), GGMLType.Q8_0: ((0, 0.002),),
                    GGMLType.Q5_K: ((0, 0.002), (2, 0.001)), GGMLType.Q6_K: ((208, 0.0002),)}
    mix = qtype_name == "Q4_K_M"
    pools: dict = {}

    def pool_of(qtype):
        if qtype not in pools:
            lay = layout(qtype)
            rng = np.random.default_rng(0)
            pool = rng.integers(0, 256, size=(64 << 20) // lay.type_size * lay.type_size, dtype=np.uint8)
            blocks = pool.reshape(-1, lay.type_size)
            for off, value in scale_fields[qtype]:
                blocks[:, off:off + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
            pools[qtype] = pool
        return pools[qtype]

    s = shape
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(s["n_layer"])
    w.add_context_length(4096)
    w.add_embedding_length(s["d_model"])
    w.add_feed_forward_length(s["d_ff"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_kv_head"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    if metadata is not None:
        metadata(w)

    def matrix(name: str, rows: int, cols: int, layer: int = 0) -> int:
        qtype = GGMLType[q4_k_m_type(name.split(".")[-2], layer, s["n_layer"]) if mix else qtype_name]
        nbytes = rows * layout(qtype).row_bytes(cols)
        w.add_tensor(name, np.resize(pool_of(qtype), nbytes).reshape(rows, -1),
                     raw_dtype=gguf.GGMLQuantizationType(int(qtype)))
        return nbytes

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, np.float32))

    d, q_dim, kv_dim = s["d_model"], s["n_head"] * s["head_dim"], s["n_kv_head"] * s["head_dim"]
    embd = matrix("token_embd.weight", s["n_vocab"], d)
    step_bytes = matrix("output.weight", s["n_vocab"], d) if mix else embd  # tied: the head reads all of it
    for i in range(s["n_layer"]):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", d)
        norm(p + "ffn_norm.weight", d)
        for name, rows, cols in (("attn_q", q_dim, d), ("attn_k", kv_dim, d), ("attn_v", kv_dim, d),
                                 ("attn_output", d, q_dim), ("ffn_gate", s["d_ff"], d), ("ffn_up", s["d_ff"], d),
                                 ("ffn_down", d, s["d_ff"])):
            step_bytes += matrix(p + name + ".weight", rows, cols, i)
    norm("output_norm.weight", d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return step_bytes


def decode_bandwidth(path: Path, step_bytes: int, copy_gbs: float, n_steps: int, listed: int = 0,
                     profile: bool = True) -> dict:
    """Batch-1 decode steps of the model alone (recorded once, replayed as a graph), as the engine's
    runner runs them, at a context of about 100 tokens; with profile, each launch also timed alone
    and the first `listed` launches listed one by one (name, grid, block, us alone)."""
    import ember.backends as backends
    from ember.backends import AttentionBatch
    from ember.gguf_loader import GGUFFile
    from ember.models import Step, load_model

    backend = backends.get_backend("cuda")
    with GGUFFile(path) as f:
        model = load_model(f, backend)
        page = 16
        cache = model.new_kv_cache(64, page)
        tables = np.arange(64, dtype=np.int32).reshape(1, 64)
        tok, pos, rows = np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32)
        slots, out = np.zeros(1, np.int64), np.zeros(1, np.int32)
        step = Step(tok, AttentionBatch(pos, rows, tables, slots, page), out)
        for p in range(100):  # fill the cache token by token (prefill speed is not measured here)
            pos[0], slots[0], tok[0] = p, p, p % 1000
            model.forward(step, cache)
        with backend.record() as rec:
            model.forward(step, cache)
        times = []
        for i in range(n_steps):
            pos[0] = slots[0] = 100 + i % 50
            t0 = time.perf_counter()
            backend.replay(rec)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        gbs = step_bytes / t / 1e9
        e0, e1 = backend.cp.cuda.Event(), backend.cp.cuda.Event()
        e0.record()
        for _ in range(20):
            if rec.graph is not None:
                rec.graph.launch(backend.cp.cuda.Stream.null)
        e1.record()
        e1.synchronize()
        gpu_ms = backend.cp.cuda.get_elapsed_time(e0, e1) / 20
        return {"step_ms": 1000 * t, "gpu_step_ms": gpu_ms, "weight_gb": step_bytes / 1e9, "weight_gbs": gbs,
                "copy_gbs": copy_gbs, "fraction_of_copy": gbs / copy_gbs, "tokens_per_s": 1 / t,
                "launches_per_step": len(rec.launches), "profile": launch_profile(backend, rec) if profile else {},
                "listed": [(backend.kernels.name_of(x.fn), x.grid[0], x.block[0], round(graph_us(backend.cp, [x], 20), 2))
                           for x in rec.launches[:listed] if hasattr(x, "fn")] if profile else []}


def prompt_profile(path: Path, n: int = 512) -> dict:
    """One n-token prompt step of the model alone (positions 0 .. n-1, one sequence), recorded once:
    its replay time, then each launch timed alone (by kernel name)."""
    import ember.backends as backends
    from ember.backends import AttentionBatch
    from ember.gguf_loader import GGUFFile
    from ember.models import Step, load_model

    backend = backends.get_backend("cuda")
    with GGUFFile(path) as f:
        model = load_model(f, backend)
        page = 16
        n_pages = -(-n // page)
        cache = model.new_kv_cache(n_pages, page)
        tables = np.arange(n_pages, dtype=np.int32).reshape(1, n_pages)
        tok = (np.arange(n, dtype=np.int32) * 7919) % 1000
        pos, rows = np.arange(n, dtype=np.int32), np.zeros(n, np.int32)
        slots, out = np.arange(n, dtype=np.int64), np.array([n - 1], np.int32)
        step = Step(tok, AttentionBatch(pos, rows, tables, slots, page), out)
        model.forward(step, cache)
        with backend.record() as rec:
            model.forward(step, cache)
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            backend.replay(rec)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        return {"tokens": n, "step_ms": 1000 * t, "tokens_per_s": n / t, "launches_per_step": len(rec.launches),
                "profile": launch_profile(backend, rec)}


# ---- single kernels ----

KERNEL_SHAPES = [  # (label, type, rows, k, n, mode): decode products of the benchmarked models' shapes
    ("1.5B qkv", "Q4_K", [1536, 256, 256], 1536, 1, "store"),
    ("1.5B o", "Q4_K", [1536], 1536, 1, "store"),
    ("1.5B gate+up", "Q4_K", [8960, 8960], 1536, 1, "silu"),
    ("1.5B gate+up +q", "Q4_K", [8960, 8960], 1536, 1, "silu_q"),
    ("1.5B down", "Q4_K", [1536], 8960, 1, "store"),
    ("1.5B down +tail", "Q4_K", [1536], 8960, 1, "tail"),
    ("1.5B o +tail", "Q4_K", [1536], 1536, 1, "tail"),
    ("1.5B o +quant_x", "Q4_K", [1536], 1536, 1, "sep"),
    ("1.5B head", "Q4_K", [151936], 1536, 1, "store"),
    ("1.5B down Q8_0", "Q8_0", [1536], 8960, 1, "store"),
    ("1.5B head Q6_K", "Q6_K", [151936], 1536, 1, "store"),
    ("1.5B down n=8", "Q4_K", [1536], 8960, 8, "store"),
    ("135M qkv Q4_1", "Q4_1", [576, 192, 192], 576, 1, "store"),
    ("135M down Q4_1", "Q4_1", [576], 1536, 1, "store"),
    ("135M down +tail", "Q4_1", [576], 1536, 1, "tail"),
    ("135M down +quant_x", "Q4_1", [576], 1536, 1, "sep"),
    ("135M head Q8_0", "Q8_0", [49152], 576, 1, "store"),
    ("270M head Q8_0", "Q8_0", [262144], 640, 1, "store"),
]


BATCH_SHAPES = [  # (label, type, rows, k, gated): products of batched decode steps
    ("135M qkv Q4_1", "Q4_1", [576, 192, 192], 576, False),
    ("135M gate+up Q4_1", "Q4_1", [1536, 1536], 576, True),
    ("135M down Q4_1", "Q4_1", [576], 1536, False),
    ("270M qk Q5_0", "Q5_0", [1024, 256], 640, False),
    ("270M gate+up Q5_0", "Q5_0", [2048, 2048], 640, True),
    ("270M o Q4_K", "Q4_K", [640], 1024, False),
    ("270M down Q6_K", "Q6_K", [640], 2048, False),
]


def kernel_times(reps: int = 40) -> dict:
    """Each decode product alone, `reps` launches captured in one CUDA graph: microseconds per
    launch (the in-graph launch gap included) and weight GB/s; plus the smallest kernel's time."""
    from ember.backends import get_backend
    from ember.backends.base import Weight
    from ember.backends.cuda.ops import MODE_RESIDUAL, MODE_SILU, DeviceMatrix, Matmul, SplitScratch, Tail, xq_bytes
    from ember.backends.cuda.ops.matmul import MS_COUNTERS, MS_PART_FLOATS
    from ember.quant import GGMLType, layout

    b = get_backend("cuda")
    cp = b.cp
    out = {}

    for label, tname, rows, k, n, mode in KERNEL_SHAPES:
        qtype = GGMLType[tname]
        rb = layout(qtype).row_bytes(k)
        ws = [Weight(f"w{i}", qtype, (r, k), DeviceMatrix(cp.random.randint(0, 256, r * rb + 64, dtype=cp.uint8), rb))
              for i, r in enumerate(rows)]
        x = cp.random.standard_normal((n, k), dtype=cp.float32)
        xq = cp.empty(xq_bytes(n, k), cp.uint8)
        ys = [cp.empty((n, r), cp.float32) for r in rows]
        Matmul([], x, [], xq=xq)._quant_x(b.kernels).run()
        kw = {}
        if mode.startswith("silu"):
            kw = {"mode": MODE_SILU, "aux": cp.empty((n, rows[0]), cp.float32)}
            if mode == "silu_q":
                kw["act_q"] = cp.empty(xq_bytes(n, rows[0]), cp.uint8)
        elif mode == "tail":  # residual add, then the next RMS norm quantized by the last block
            res, d = cp.zeros((n, rows[0]), cp.float32), rows[0]
            kw = {"mode": MODE_RESIDUAL, "aux": res,
                  "tail": Tail(b._new_counter(), res, pre_w=cp.ones(d, cp.float32), pre_eps=1e-5,
                               pre_h=cp.empty((n, d), cp.float32), pre_q=cp.empty(xq_bytes(n, d), cp.uint8))}
        extra = []
        if mode == "sep":  # the same work as a tail, as its own quant_x launch
            res, d = cp.zeros((n, rows[0]), cp.float32), rows[0]
            kw = {"mode": MODE_RESIDUAL, "aux": res}
            nxt = Matmul([], cp.empty((n, d), cp.float32), [], xq=cp.empty(xq_bytes(n, d), cp.uint8), src=res,
                         norm_w=cp.ones(d, cp.float32), eps=1e-5)
            extra = [nxt._quant_x(b.kernels)]
        op = Matmul(ws, x, ys, xq=xq, quant_in=False, **kw)
        us = graph_us(cp, op.launches(b.kernels) + extra, reps)
        nbytes = sum(r * rb for r in rows)
        out[label] = {"us": round(us, 2), "gbs": round(nbytes / us / 1e3, 1), "mb": round(nbytes / 1e6, 2)}
    for label, tname, rows, k, gated in BATCH_SHAPES:  # batched decode: 16 and 64 activation rows
        qtype = GGMLType[tname]
        rb = layout(qtype).row_bytes(k)
        ws = [Weight(f"w{i}", qtype, (r, k), DeviceMatrix(cp.random.randint(0, 256, r * rb + 64, dtype=cp.uint8), rb))
              for i, r in enumerate(rows)]
        for n in (16, 64):
            x = cp.random.standard_normal((n, k), dtype=cp.float32)
            xq = cp.empty(xq_bytes(n, k), cp.uint8)
            ys = [cp.empty((n, r), cp.float32) for r in rows]
            kw = {"mode": MODE_SILU, "aux": cp.empty((n, rows[0]), cp.float32)} if gated else {}
            split = dict(split_buf=SplitScratch(b._scratch_f32("mm_split_part", MS_PART_FLOATS),
                                                b._zeroed_u32("mm_split_counters", MS_COUNTERS)))
            ops = {"mv_n8": Matmul(ws, x, ys, xq=xq, quant_in=False, mv_rows=64, **kw),  # groups of 8 rows
                   "mm_tile": Matmul(ws, x, ys, mv_rows=8, n_sm=b.n_sm),  # no fused epilogue
                   "mm_split": Matmul(ws, x, ys, mv_rows=8, n_sm=b.n_sm, **split, **kw)}
            assert ops["mm_split"].split()
            for name, op in ops.items():
                out[f"{label} n={n} {name}"] = {"us": round(graph_us(cp, op.launches(b.kernels), reps), 2)}
    from ember.backends.cuda.ops import TopK

    for rows, vocab in ((1, 262144), (64, 262144), (64, 49152)):
        logits = cp.random.standard_normal((rows, vocab), dtype=cp.float32)
        for k in (1, 40):
            op = TopK(logits, k, cp.empty((rows, k), cp.int32), cp.empty((rows, k), cp.float32))
            out[f"top-{k} {rows}x{vocab}"] = {"us": round(graph_us(cp, op.launches(b.kernels), 5), 2)}
    x = cp.random.standard_normal((1, 576), dtype=cp.float32)
    tiny = Matmul([], x, [], xq=cp.empty(xq_bytes(1, 576), cp.uint8))._quant_x(b.kernels)
    out["quant_x 576 (floor)"] = {"us": round(graph_us(cp, [tiny], reps), 2)}
    return out


# ---- cold start ----

CHILD = """
import json, sys, time
t_import = time.time()
from ember.engine import LLM
from ember.sampler import SamplingParams
llm = LLM(sys.argv[1], device="cuda", ctx=64, slots=1)
t_loaded = time.time()
llm.generate([1, 2, 3], 1, SamplingParams(temperature=0.0, ignore_eos=True))
t_first = time.time()
k = llm.model.backend.kernels.stats
print(json.dumps({"t_import": t_import, "t_loaded": t_loaded, "t_first": t_first,
                  "compiled": k.compiled, "from_cache": k.loaded_from_cache}))
llm.close()
"""


def cold_starts(path: str, reps: int) -> dict:
    """Process start to first token: with an empty kernel cache, then with the cache on disk."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, EMBER_KERNEL_CACHE=cache, PYTHONPATH=os.pathsep.join(
            [str(ROOT), os.environ.get("PYTHONPATH", "")]))
        for label in ["cold", *["warm"] * reps]:
            t0 = time.time()
            proc = subprocess.run([sys.executable, "-c", CHILD, path], env=env, capture_output=True, text=True,
                                  timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"child failed: {proc.stderr[-2000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            entry = {"first_token_s": r["t_first"] - t0, "python_start_s": r["t_import"] - t0,
                     "load_s": r["t_loaded"] - r["t_import"], "compiled": r["compiled"], "from_cache": r["from_cache"]}
            out.setdefault(label, []).append(entry)
    return out


# ---- driver ----

def section(results: dict, name: str, fn, *args):
    t0 = time.perf_counter()
    try:
        results[name] = fn(*args)
    except Exception as e:  # one failing section must not lose the others
        results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        print(f"[{name}] FAILED: {type(e).__name__}: {e}", flush=True)
    print(f"[{name}] {time.perf_counter() - t0:.1f} s: {json.dumps(results[name], default=str)[:600]}", flush=True)
    return results[name]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=[], help="NAME=PATH of GGUF files (skeletons unpacked)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, one 1.5 B type, shorter runs")
    ap.add_argument("--skip", nargs="*", default=[],
                    help="sections to skip: kernels single variants tiles many shared stream_variants stream_ahead "
                    "(the 64-stream runs' threads and switch variants) roofline roofline_variants cold")
    ap.add_argument("--variants", default="", help="comma-separated variants to run (default: all): decode "
                    + ", ".join(v[0] for v in DECODE_VARIANTS) + "; 1.5 B roofline "
                    + ", ".join(v[0] for v in ROOFLINE_VARIANTS))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cuda.json")
    args = ap.parse_args()
    chosen = set(args.variants.split(",")) if args.variants else None  # None: every variant
    import cupy as cp

    reps = 2 if args.quick else 5
    results: dict = {"quick": args.quick, "models": {}}
    section(results, "copy_gbs", copy_bandwidth, cp)
    if "kernels" not in args.skip:
        section(results, "kernels", kernel_times)
    for spec in args.models:
        name, _, path = spec.partition("=")
        r = results["models"].setdefault(name, {})
        if "single" not in args.skip:
            section(r, "single", single_stream, path, reps)
        if "variants" not in args.skip:
            for label, spec in DECODE_VARIANTS:
                if chosen is None or label in chosen:
                    section(r, label, variant, spec, decode_only, path, reps)
        if "tiles" not in args.skip:
            for rows in (128, 64, 0):
                section(r, f"prefill_tiles_{rows or 'auto'}", with_config, {"tile_rows": rows}, prefill_only, path,
                        reps)
        if "many" not in args.skip:
            section(r, "many", many_streams, path, 64, 512, 32 if args.quick else 128, False)
            if "stream_variants" not in args.skip:
                section(r, "many_threads", many_streams, path, 64, 512, 32 if args.quick else 128, False, "threads")
        if "shared" not in args.skip:
            section(r, "shared", many_streams, path, 64, 512, 32 if args.quick else 128, True)
        if "shared" not in args.skip and "stream_variants" not in args.skip:
            section(r, "shared_threads", many_streams, path, 64, 512, 32 if args.quick else 128, True, "threads")
            section(r, "shared_att_waves_8", with_config, {"att_waves": 8}, many_streams, path, 64, 512,
                    32 if args.quick else 128, True)
        if "stream_ahead" not in args.skip:  # the 64-stream runs with decode steps one after the other
            for kind, shared in (("many", False), ("shared", True)):
                if kind not in args.skip:
                    section(r, f"{kind}_ahead_0", with_engine, {"decode_ahead": False}, many_streams, path, 64, 512,
                            32 if args.quick else 128, shared)
        if "cold" not in args.skip and name == (args.models[0].partition("=")[0]):
            section(r, "cold_start", cold_starts, path, 1 if args.quick else 2)
    if "roofline" not in args.skip:
        copy_gbs = results["copy_gbs"] if isinstance(results["copy_gbs"], float) else 4300.0
        with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
            for qtype in (["Q4_K"] if args.quick else ["Q4_K", "Q8_0"]):
                path = Path(tmp) / f"llama1.5b-{qtype}.gguf"
                t0 = time.perf_counter()
                step_bytes = write_big_model(path, qtype, LLAMA_1_5B)
                print(f"wrote {path.name} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s")
                section(results, f"roofline_{qtype}", decode_bandwidth, path, step_bytes, copy_gbs,
                        100 if args.quick else 300)
                for label, spec in ROOFLINE_VARIANTS if "roofline_variants" not in args.skip else []:
                    if chosen is None or label in chosen:
                        section(results, f"roofline_{qtype}_{label}", variant, spec, decode_bandwidth, path,
                                step_bytes, copy_gbs, 100 if args.quick else 300)
                path.unlink()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str))
    print_table(results)
    print(f"wrote {args.out}")


def print_table(results: dict) -> None:
    print(f"\ndevice copy bandwidth: {results.get('copy_gbs')} GB/s")
    print(f"{'model':12} {'test':14} {'ember':>10} {'llama.cpp':>10} {'ratio':>6} {'goal':>5}")
    for name, r in results["models"].items():
        peer = PEERS.get(name, {})
        rows = [("pp512", "single", "pp512"), ("tg128", "single", "tg128"), ("batched_total", "many", "total_tps"),
                ("shared_gen", "shared", "gen_tps")]
        for test, sec, key in rows:
            value = r.get(sec, {}).get(key)
            if value is None:  # a section that raised, or one left out (--skip)
                print(f"{name:12} {test:14} {'failed' if sec in r else 'skipped':>10}")
                continue
            p = peer.get(test)
            ratio = f"{value / p:6.2f}" if p else "     -"
            print(f"{name:12} {test:14} {value:10.0f} {p or 0:10.0f} {ratio} {GOALS[test]:5.1f}")
        single = r.get("single", {})
        if "graph_step_ms" in single:
            print(f"{name:12} graph step {single['graph_step_ms']} ms, launches {single.get('launches_per_replay')}")
        for label, _ in DECODE_VARIANTS:
            v = r.get(label) or {}
            if "tg128" in v:
                print(f"{name:12} {label:16} tg {v['tg128']:.0f}, step {v['graph_step_ms']:.3f} ms, "
                      f"launches {v['launches_per_replay']}")
        for label in ("prefill_tiles_128", "prefill_tiles_64", "prefill_tiles_auto"):
            v = r.get(label) or {}
            if "pp512" in v:
                prof = v.get("profile") or {}
                top = ", ".join(f"{k} {c[0]}x {c[1]:.0f}us" for k, c in list(prof.get("kernels", {}).items())[:6])
                print(f"{name:12} {label[8:]:17} pp512 {v['pp512']:.0f}; prompt step kernels alone sum "
                      f"{prof.get('sum_us')} us: {top}")
        for label in ("many", "shared", "many_threads", "shared_threads", "shared_att_waves_8", "many_ahead_0",
                      "shared_ahead_0"):
            v = r.get(label) or {}
            if "total_tps" in v and label not in ("many", "shared"):
                print(f"{name:12} {label}: total {v['total_tps']:.0f}, generation {v['gen_tps']:.0f} tok/s")
            if v.get("phases"):
                print(f"{name:12} {label:6} steps: {v['phases']} ({v.get('shapes_recorded')} shapes recorded), wall "
                      f"{v['wall_s']:.3f} s")
            if v.get("decode_steps"):
                d = v["decode_steps"]
                print(f"{name:12} {label:6} decode steps: {d['steps']}, step p50 {d['step_ms_p50']:.2f} ms, runner p50 "
                      f"{d['runner_ms_p50']:.2f} ms, replay alone {v.get('decode_replay_ms')} ms")
            prof = v.get("decode_profile") or {}
            if prof.get("kernels"):
                top = ", ".join(f"{k} {c[0]}x {c[1]:.0f}us" for k, c in list(prof["kernels"].items())[:8])
                print(f"{name:12} {label:6} {v['streams']}-token step kernels alone sum {prof['sum_us']} us: {top}")
        prof = single.get("profile") or {}
        if prof.get("kernels"):
            top = ", ".join(f"{k} {v[0]}x {v[1]:.0f}us" for k, v in list(prof["kernels"].items())[:8])
            print(f"{name:12} kernels alone sum {prof['sum_us']} us: {top}")
        for label, runs in r.get("cold_start", {}).items():
            if isinstance(runs, list):
                print(f"{name:12} {label} start to first token: {[round(x['first_token_s'], 2) for x in runs]} s")
    for label, r in (results.get("kernels") or {}).items():
        if isinstance(r, dict) and "us" in r:
            print(f"kernel {label:22} {r['us']:8.2f} us" + (f"  {r['gbs']:7.1f} GB/s of {r['mb']} MB" if "gbs" in r else ""))
    for key, r in results.items():
        if key.startswith("roofline") and "weight_gbs" in r:
            print(f"{key}: {r['step_ms']:.3f} ms/step, {r['weight_gbs']:.0f} GB/s = "
                  f"{100 * r['fraction_of_copy']:.0f}% of copy ({r['weight_gb']:.2f} GB/step, goal 50%); "
                  f"graph alone {r.get('gpu_step_ms', 0):.3f} ms")
            prof = r.get("profile") or {}
            if prof.get("kernels"):
                top = ", ".join(f"{k} {v[0]}x {v[1]:.0f}us" for k, v in list(prof["kernels"].items())[:8])
                print(f"{key}: kernels alone sum {prof['sum_us']} us: {top}")


if __name__ == "__main__":
    main()
