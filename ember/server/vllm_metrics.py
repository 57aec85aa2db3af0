"""vLLM's metric names, for the routers and autoscalers that read them (llm-d, the Gateway API
Inference Extension, vLLM's production-stack router).

Same meaning as vLLM's: queue and batch sizes in requests, KV usage as the share of pages that
running requests hold (0..1; pages only the prefix cache keeps count as free, as vLLM's cached
blocks do), prefix-cache queries and hits in prompt tokens, and time to first token. Labelled
with model_name like vLLM's.
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..engine.metrics import Histogram


def vllm_families(view, model_name: str):
    """The families for one scrape of `view` (metrics.EngineView)."""
    m, kv, labels = view.metrics, view.kv, [model_name]
    yield _gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels, view.running)
    yield _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, view.waiting)
    yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels,
                 kv.pages_in_use / kv.pages_total if kv.pages_total else 0.0)
    yield _counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                   labels, m.prompt_tokens)
    yield _counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                   labels, m.prompt_tokens_cached)
    ttft = HistogramMetricFamily("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                 labels=["model_name"])
    buckets, total = _merged(m.ttft_hit, m.ttft_miss)
    ttft.add_metric(labels, buckets, total)
    yield ttft


def _gauge(name: str, doc: str, labels: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


def _counter(name: str, doc: str, labels: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


def _merged(*hists: Histogram) -> tuple[list[tuple[str, float]], float]:
    """One histogram of several with the same bounds: cumulative (le, count) pairs and the sum."""
    bounds = hists[0].buckets
    counts = [sum(h.counts[i] for h in hists) for i in range(len(bounds) + 1)]
    out, running = [], 0
    for bound, count in zip(bounds, counts):
        running += count
        out.append((repr(float(bound)), running))
    out.append(("+Inf", running + counts[-1]))
    return out, sum(h.sum for h in hists)
