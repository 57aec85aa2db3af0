"""Measurements the engine keeps (read by the HTTP layer's /metrics and by benchmarks)."""
from __future__ import annotations

import bisect
import threading
from collections import deque
from dataclasses import dataclass, field

# Histogram bucket bounds in seconds (Prometheus-style, cumulative on export).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """Bucket counts plus a window of recent samples for percentiles."""

    def __init__(self, buckets=LATENCY_BUCKETS, window: int = 4096):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0
        self.recent: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1
        self.recent.append(value)

    def percentile(self, q: float) -> float:
        """q in [0, 100] over the recent window; 0.0 when empty."""
        if not self.recent:
            return 0.0
        data = sorted(self.recent)
        return data[min(len(data) - 1, int(round(q / 100 * (len(data) - 1))))]


# the prefix cache's path, the shared n-gram index, the request's own tokens, the draft model
DRAFT_SOURCES = ("tree", "index", "lookup", "draft")


@dataclass(slots=True)
class DraftStats:
    """One draft source's record (speculative decoding): drafts verified, their tokens, tokens kept."""

    drafts: int = 0
    drafted: int = 0
    accepted: int = 0


@dataclass
class EngineMetrics:
    prompt_tokens: int = 0  # prompt tokens of admitted sequences
    prompt_tokens_cached: int = 0  # of which served from the prefix cache
    prompt_tokens_computed: int = 0  # prompt tokens actually run through the model
    generated_tokens: int = 0
    forced_tokens: int = 0  # of which the grammar allowed only one (appended without sampling)
    requests_started: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    preemptions: int = 0
    steps: int = 0
    sequence_steps: int = 0  # sequences computed, summed over the steps
    argmax_steps: int = 0  # of which only token ids came back (greedy rows reduced on the device)
    ahead_steps: int = 0  # of which launched before the host had read the step before (decode_ahead)
    draft_tokens: int = 0  # tokens drafted and verified (speculative decoding)...
    draft_tokens_accepted: int = 0  # ...of which kept
    drafts: dict = field(default_factory=lambda: {s: DraftStats() for s in DRAFT_SOURCES})  # by source
    ttft_hit: Histogram = field(default_factory=Histogram)  # half or more of the prompt was cached
    ttft_miss: Histogram = field(default_factory=Histogram)
    inter_token: Histogram = field(default_factory=Histogram)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count_step(self, n_seqs: int, best_only: bool) -> None:
        self.steps += 1
        self.sequence_steps += n_seqs
        self.argmax_steps += best_only

    def count_draft(self, source: str, drafted: int, accepted: int) -> None:
        self.draft_tokens += drafted
        self.draft_tokens_accepted += accepted
        stats = self.drafts[source]
        stats.drafts += 1
        stats.drafted += drafted
        stats.accepted += accepted

    @property
    def cache_hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache."""
        return self.prompt_tokens_cached / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True, slots=True)
class KVUsage:
    pages_total: int
    pages_free: int
    pages_in_use: int  # referenced by running sequences
    pages_cached_only: int  # held only by the prefix cache (evictable)
    page_size: int
    cached_tokens: int
