"""GET /metrics: Prometheus text exposition through prometheus_client.

llama-server's counters (`llamacpp:` names), vLLM's that routers read (`vllm:`, vllm_metrics.py),
plus what ember's engine measures (`ember:`):
prefix-cache hit rate, cached prompt tokens, time to first token split by cache hit/miss,
queue length and KV pages. Values are read from the engine when scraped (the counters outlive
a sleeping model); the registry belongs to the app, not to the module.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from starlette.requests import Request
from starlette.responses import Response

from ..engine.metrics import Histogram, KVUsage
from .state import ServerState
from .vllm_metrics import vllm_families


class EngineCollector:
    """A prometheus_client collector reading the server's engine on every scrape."""

    def __init__(self, state: ServerState):
        self.state = state

    def collect(self):
        view = EngineView.of(self.state)
        if view is None:
            return
        yield from llama_families(view, self.state)
        yield from ember_families(view, self.state)
        yield from tier_families(view)
        yield from vllm_families(view, self.state.info.id)


class EngineView:
    """What a scrape reads: the engine's counters, queues and KV usage (those of an empty
    engine while the model sleeps)."""

    def __init__(self, metrics, running: int, waiting: int, kv: KVUsage, tiers=None, page_nbytes: int = 0):
        self.metrics, self.running, self.waiting, self.kv = metrics, running, waiting, kv
        self.tiers, self.page_nbytes = tiers, page_nbytes  # the engine's TieredCache (or None), a page's bytes

    @classmethod
    def of(cls, state: ServerState) -> EngineView | None:
        model = state.model
        if model is not None and model.engine is None:  # embeddings mode: no generation engine
            return None
        if model is not None:
            engine = model.engine
            return cls(engine.metrics, len(engine.scheduler.running), len(engine.scheduler.waiting),
                       engine.kv_usage(), engine.tiers, engine.cache.page_nbytes)
        if state.sleeping and state.info is not None and state.engine_metrics() is not None:
            info = state.info
            kv = KVUsage(info.kv_pages, info.kv_pages, 0, 0, info.page_size, 0)
            return cls(state.engine_metrics(), 0, 0, kv)
        return None


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def llama_families(view: EngineView, state: ServerState):
    m, stats = view.metrics, state.stats
    yield _counter("llamacpp:prompt_tokens", "Number of prompt tokens processed, excluding cached tokens.",
                   m.prompt_tokens_computed)
    yield _counter("llamacpp:prompt_tokens_cached", "Number of prompt tokens reused from the prefix cache.",
                   m.prompt_tokens_cached)
    yield _counter("llamacpp:prompt_seconds", "Prompt process time", stats.prompt_seconds)
    yield _counter("llamacpp:tokens_predicted", "Number of generation tokens processed.", m.generated_tokens)
    yield _counter("llamacpp:tokens_predicted_seconds", "Predict process time", stats.predicted_seconds)
    yield _counter("llamacpp:n_decode", "Total number of engine steps (batched forward passes)", m.steps)
    yield _counter("llamacpp:n_drafted", "Number of speculative draft tokens verified.", m.draft_tokens)
    yield _counter("llamacpp:n_drafted_accepted", "Number of speculative draft tokens accepted.",
                   m.draft_tokens_accepted)
    # llama-server declares this one a counter without the _total suffix; a gauge keeps its name
    yield _gauge("llamacpp:n_tokens_max", "Largest observed sequence length (prompt + generation).",
                 stats.n_tokens_max)
    yield _gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                 m.prompt_tokens_computed / stats.prompt_seconds if stats.prompt_seconds else 0.0)
    yield _gauge("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                 m.generated_tokens / stats.predicted_seconds if stats.predicted_seconds else 0.0)
    yield _gauge("llamacpp:requests_processing", "Number of requests processing.", view.running)
    yield _gauge("llamacpp:requests_deferred", "Number of requests deferred.", view.waiting)
    yield _gauge("llamacpp:n_busy_slots_per_decode", "Average number of sequences computed per engine step.",
                 m.sequence_steps / m.steps if m.steps else 0.0)
    kv = view.kv
    yield _gauge("llamacpp:kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.",
                 (kv.pages_total - kv.pages_free) / kv.pages_total if kv.pages_total else 0.0)


def _draft_families(view: EngineView):
    """Speculative decoding by draft source (tree, index, lookup): drafts, their tokens, kept tokens."""
    labels = ["source"]
    families = (CounterMetricFamily("ember:drafts", "Drafts verified, by source.", labels=labels),
                CounterMetricFamily("ember:draft_tokens", "Draft tokens verified, by source.", labels=labels),
                CounterMetricFamily("ember:draft_tokens_accepted", "Draft tokens kept, by source.", labels=labels))
    for source, s in view.metrics.drafts.items():
        for family, value in zip(families, (s.drafts, s.drafted, s.accepted)):
            family.add_metric([source], value)
    yield from families


def ember_families(view: EngineView, state: ServerState):
    m = view.metrics
    yield _counter("ember:prompt_tokens", "Prompt tokens of admitted sequences (cached or computed).",
                   m.prompt_tokens)
    yield _counter("ember:prompt_tokens_cached", "Prompt tokens served from the prefix cache.", m.prompt_tokens_cached)
    yield _gauge("ember:prefix_cache_hit_ratio", "Share of prompt tokens served from the prefix cache.",
                 m.cache_hit_rate)
    yield from _draft_families(view)
    yield _counter("ember:forced_tokens", "Generated tokens a grammar left no choice about (appended unsampled).",
                   m.forced_tokens)
    ttft = HistogramMetricFamily("ember:time_to_first_token_seconds",
                                 "Submission to first token; cache=hit when half or more of the prompt was cached.",
                                 labels=["cache"])
    for label, hist in (("hit", m.ttft_hit), ("miss", m.ttft_miss)):
        ttft.add_metric([label], _buckets(hist), hist.sum)
    yield ttft
    inter = HistogramMetricFamily("ember:inter_token_seconds", "Time between consecutive tokens of a sequence.")
    inter.add_metric([], _buckets(m.inter_token), m.inter_token.sum)
    yield inter
    yield _gauge("ember:requests_waiting", "Sequences waiting for admission (queue length).", view.waiting)
    yield _gauge("ember:requests_running", "Sequences running.", view.running)
    yield _counter("ember:requests_finished", "Sequences finished (any reason).", m.requests_finished)
    yield _counter("ember:requests_cancelled", "Sequences cancelled (client gone or shutdown).", m.requests_cancelled)
    yield _counter("ember:requests_rejected_queue_full", "Requests refused with 503 because the queue was full.",
                   state.stats.rejected_queue_full)
    yield _counter("ember:preemptions", "Sequences preempted to free KV pages.", m.preemptions)
    kv = view.kv
    pages = GaugeMetricFamily("ember:kv_pages", "KV cache pages by state.", labels=["state"])
    pages.add_metric(["in_use"], kv.pages_in_use)
    pages.add_metric(["cached"], kv.pages_cached_only)
    pages.add_metric(["free"], kv.pages_free)
    yield pages
    yield _gauge("ember:kv_usage_ratio", "Share of KV pages held by running sequences.",
                 kv.pages_in_use / kv.pages_total if kv.pages_total else 0.0)
    yield _gauge("ember:kv_cached_tokens", "Tokens held by the prefix cache.", kv.cached_tokens)


def tier_families(view: EngineView):
    """The prefix cache's tiers: the KV pool (device), host memory (ram), page files (disk)."""
    kv, tiers = view.kv, view.tiers
    pool_pages = kv.pages_total - kv.pages_free
    held = {"device": (pool_pages, pool_pages * view.page_nbytes)}
    if tiers is not None:
        for name, tier in (("ram", tiers.ram), ("disk", tiers.disk)):
            if tier is not None:
                held[name] = (len(tier), tier.nbytes)
    pages = GaugeMetricFamily("ember:kv_tier_pages", "KV pages held, per tier of the prefix cache.", labels=["tier"])
    size = GaugeMetricFamily("ember:kv_tier_bytes", "Bytes of KV pages held, per tier.", labels=["tier"])
    for name, (n, nbytes) in held.items():
        pages.add_metric([name], n)
        size.add_metric([name], nbytes)
    yield pages
    yield size
    st = tiers.stats if tiers is not None else None
    restored = {t: st.hits[t] * kv.page_size if st else 0 for t in ("ram", "disk")}
    hits = CounterMetricFamily("ember:prefix_cache_hits", "Prompt tokens served from each tier of the prefix cache.",
                               labels=["tier"])
    hits.add_metric(["device"], max(0, view.metrics.prompt_tokens_cached - sum(restored.values())))
    for name, n in restored.items():
        hits.add_metric([name], n)
    yield hits
    moved = CounterMetricFamily("ember:kv_tier_moved_bytes", "Bytes of KV pages written to (in) and read back from "
                                "(out) each tier.", labels=["tier", "direction"])
    for name in ("ram", "disk"):
        moved.add_metric([name, "in"], st.bytes_in[name] if st else 0)
        moved.add_metric([name, "out"], st.bytes_out[name] if st else 0)
    yield moved
    yield _counter("ember:kv_restores", "Prompts that got KV pages back from host memory or disk.",
                   st.restores if st else 0)
    yield _counter("ember:kv_restore_seconds", "Time spent getting KV pages back from host memory or disk.",
                   st.restore_seconds if st else 0.0)


def _buckets(hist: Histogram) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs, +Inf last."""
    counts, running, out = list(hist.counts), 0, []
    for bound, count in zip(hist.buckets, counts):
        running += count
        out.append((repr(float(bound)), running))
    out.append(("+Inf", running + counts[-1]))
    return out


def make_registry(state: ServerState) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(state))
    return registry


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.ember
    state.require_info()  # answers while asleep and while shutting down, unlike the generation routes
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST,
                    headers={"Process-Start-Time-Unix": str(int(state.started))})
