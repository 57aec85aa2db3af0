"""Continuous batching: each step mixes one decode token of every running sequence with
chunks of prefill for new ones, under a token budget.

Admission takes turns between clients (the one admitted least recently goes first, so one
client's hundred queued requests cannot starve another's one); among a client's requests it
prefers the longest cached prefix, with aging so that nothing starves. A sequence whose prompt
shares more with a prefill in flight than the cache holds yet waits for that prefill to be
cached instead of computing it twice.
When pages run out: evict cached prefixes, then preempt the youngest running sequence
(its computed tokens go to the prefix cache, so it resumes cheaply).

A running sequence pins only the cached pages it uses itself: a page it copied away from
(copy on write) or that another sequence computed alike stays evictable. So once the unpinned
cache is evicted, every page in use is some running sequence's own, and the first sequence of
a step, which may preempt all the others, always gets its page: a sequence that fits the pool
always finishes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .pages import PagePool
from .radix import RadixCache, common_prefix
from .sequence import Sequence, Status


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_seqs: int = 16  # running sequences at once
    max_batch_tokens: int = 512  # tokens computed per step
    max_logit_rows: int = 64  # rows of logits per step (the model's buffer)
    aging_tokens: int = 64  # priority a waiting sequence gains per step, in tokens of cached prefix
    prefix_cache: bool = True  # off: nothing is matched or kept (a baseline for measurements)

    def __post_init__(self):
        for name in ("max_seqs", "max_batch_tokens", "max_logit_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.aging_tokens < 0:
            raise ValueError(f"aging_tokens must be >= 0, got {self.aging_tokens}")


@dataclass(slots=True)
class Chunk:
    seq: Sequence
    start: int  # first position computed
    n: int  # positions computed: start .. start + n - 1
    logit_rows: list[int]  # positions whose logits the step returns
    draft: list[int] = field(default_factory=list)  # the last len(draft) positions' tokens: a draft to verify

    def token_ids(self) -> list[int]:
        """The tokens the chunk computes: the sequence's, then its draft's."""
        own = self.seq.tokens[self.start:self.start + self.n - len(self.draft)]
        return own + self.draft if self.draft else own


@dataclass(slots=True)
class Plan:
    chunks: list[Chunk] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) pages, before the step

    @property
    def n_tokens(self) -> int:
        return sum(c.n for c in self.chunks)


def _running_order(s: Sequence) -> tuple[bool, int]:
    """Sort key of running sequences within a step: decodes before prefills (Sequence.in_prefill,
    spelled out: this runs for every sequence of every step), then by admission."""
    n = len(s.tokens)
    return (n - s.n_computed > 1 or n == s.n_prompt, s.admitted_at)


@dataclass(slots=True)
class _Budget:
    tokens: int
    rows: int


class Scheduler:
    def __init__(self, pool: PagePool, tree: RadixCache, config: SchedulerConfig = SchedulerConfig()):
        self.pool, self.tree, self.config = pool, tree, config
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.step_no = 0
        self.n_preemptions = 0
        self.n_admissions = 0
        self._turns: dict[str, int] = {}  # client -> n_admissions at its latest admission
        # lookups repeated while one schedule() admits many requests (each pick scans every waiting
        # request against the cache and every running prefill): cached lengths by sequence id,
        # valid while the tree's version holds; common prefixes by pair of sequence ids
        # (a sequence's tokens do not change within a step)
        self._cached_memo: dict[int, tuple[int, int]] = {}
        self._common_memo: dict[tuple[int, int], int] = {}

    def add(self, seq: Sequence) -> None:
        max_len = self.pool.n_pages * self.pool.page_size
        if len(seq.tokens) + seq.max_new_tokens > max_len:
            raise ValueError(f"{len(seq.tokens)} + {seq.max_new_tokens} tokens exceed the KV cache ({max_len} tokens)")
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----
    def schedule(self) -> Plan:
        self.step_no += 1
        self._cached_memo.clear()
        self._common_memo.clear()
        plan = Plan()
        budget = _Budget(self.config.max_batch_tokens, self.config.max_logit_rows)
        planned: set[int] = set()
        # decodes first (one token each), oldest first; then prefill continuations. A sequence with
        # nothing pending (a draft model's between its drafts, draftmodel.py) sits the step out
        for seq in sorted(self.running, key=_running_order):
            if seq.status is Status.RUNNING and seq.n_pending and budget.tokens > 0:
                self._plan(seq, plan, budget, planned)
        while self.waiting and len(self.running) < self.config.max_seqs and budget.tokens > 0:
            seq = self._pick_waiting()
            if seq is None or not self._admit(seq, plan, budget, planned):
                break
        for seq in self.waiting:
            seq.waited_steps += 1
        self._forget_idle_clients()
        return plan

    def plan_ahead(self, chunks: list[Chunk]) -> Plan | None:
        """The step after the one of `chunks` (decode tokens, not yet complete), for an engine that
        launches it before that one's results are read: each sequence one position on, a page
        reserved for it where needed (nobody preempted). None when a page cannot be had."""
        plan = Plan()
        for c in chunks:
            start = c.start + 1
            if not self._reserve(c.seq, start, 1, plan, None):
                return None
            plan.chunks.append(Chunk(c.seq, start, 1, [start]))
        self.step_no += 1
        for seq in self.waiting:
            seq.waited_steps += 1
        return plan

    def _plan(self, seq: Sequence, plan: Plan, budget: _Budget, planned: set[int], may_preempt: bool = True) -> bool:
        start = seq.n_computed
        if len(seq.tokens) - start == 1 and len(seq.tokens) > seq.n_prompt and budget.rows > 0 \
                and budget.tokens > 0 and not seq.prompt_logits:
            n, rows = 1, [start]  # a decode token (what _chunk gives it, without its general case)
        else:
            n, rows = self._chunk(seq, budget)
        if n == 0:
            return False
        if not self._reserve(seq, start, n, plan, planned if may_preempt else None):
            return False
        draft = self._draft_room(seq, start, budget) if seq.draft and rows == [start] else []
        seq.draft = []
        draft_rows = list(range(start + 1, start + 1 + len(draft)))
        plan.chunks.append(Chunk(seq, start, n + len(draft), rows + draft_rows, draft))
        planned.add(seq.id)
        budget.tokens -= n + len(draft)
        budget.rows -= len(rows) + len(draft)
        return True

    def _draft_room(self, seq: Sequence, start: int, budget: _Budget) -> list[int]:
        """The part of seq's draft (positions after start) this step has room for: within the
        budget, on pages seq holds or free ones (a draft never evicts or preempts)."""
        n = min(len(seq.draft), budget.tokens - 1, budget.rows - 1)
        P = self.pool.page_size
        room = len(seq.pages) * P - start - 1  # positions after start on seq's own pages
        while room < n and self.pool.n_free:
            seq.pages.append(self.pool.allocate())
            room += P
        return seq.draft[:max(0, min(n, room))]

    def _chunk(self, seq: Sequence, budget: _Budget) -> tuple[int, list[int]]:
        """How many pending tokens of seq fit this step, and which positions need logits."""
        start = seq.n_computed
        n = min(seq.n_pending, budget.tokens)
        if seq.prompt_logits:
            first = max(start, seq.prompt_logits_from)
            n = min(n, max(first - start, 0) + budget.rows)
            return n, list(range(first, start + n))
        completes = n == seq.n_pending and (seq.wants_sample or seq.n_generated > 0)
        if completes and budget.rows < 1:
            n -= 1  # leave the last token (the one that needs logits) for a later step
            completes = False
        return n, [start + n - 1] if completes else []

    def _reserve(self, seq: Sequence, start: int, n: int, plan: Plan, planned: set[int] | None) -> bool:
        """Pages for positions start..start+n-1 of seq: new pages, or private copies of shared ones.
        `planned`: sequences already in this step (never preempted); None: preempt nobody."""
        P = self.pool.page_size
        return all(self._own_page(seq, idx, plan, planned) for idx in range(start // P, (start + n - 1) // P + 1))

    def _own_page(self, seq: Sequence, idx: int, plan: Plan, planned: set[int] | None) -> bool:
        """Page idx of seq's table held by seq alone: as it is where nobody else holds it (also once
        eviction has dropped the others' references), else a new page, a copy where seq had one."""
        if idx < len(seq.pages) and self.pool.shared(seq.pages[idx]) and seq.node is not None:
            self._pin_used(seq, seq.node, idx)  # about to copy: the cache's page is not seq's to keep
        while True:
            old = seq.pages[idx] if idx < len(seq.pages) else None
            if old is not None and not self.pool.shared(old):
                return True
            if self.pool.n_free:
                break
            if not self._make_room(seq, planned):
                return False
        page = self.pool.allocate()
        if old is None:
            seq.pages.append(page)
        else:  # copy on write: the page is also the cache's or another sequence's
            plan.copies.append((old, page))
            self.pool.release([old])
            seq.pages[idx] = page
        return True

    def _make_room(self, requester: Sequence, planned: set[int] | None) -> bool:
        """Evict cached prefixes, else preempt the youngest running sequence not yet in this step
        (none where `planned` is None). False when neither is possible."""
        version = self.tree.version
        if self.tree.evict(1) or self.tree.version != version:
            return True  # a page came free, or references to seq's shared page may have gone
        victim = None if planned is None else self._youngest_unplanned(requester, planned)
        if victim is None:
            return False
        self.preempt(victim)
        return True

    def _pin_used(self, seq: Sequence, node, n_pages: int) -> None:
        """Pin (instead of seq's pinned node) the longest part of node's path whose pages are among
        seq's first n_pages, at the same places: seq keeps in the cache only what it uses."""
        P, keep = self.pool.page_size, None
        for n in self.tree.path(node):
            first = n.start // P
            if first + len(n.pages) > n_pages or seq.pages[first:first + len(n.pages)] != n.pages:
                break
            keep = n
        if keep is not None:
            self.tree.pin(keep)
        if seq.node is not None:
            self.tree.unpin(seq.node)
        seq.node = keep

    def _youngest_unplanned(self, requester: Sequence, planned: set[int]) -> Sequence | None:
        candidates = [s for s in self.running if s is not requester and s.id not in planned]
        return max(candidates, key=lambda s: s.admitted_at, default=None)

    # ---- admission ----
    def _pick_waiting(self) -> Sequence | None:
        """The next to admit: of the client admitted least recently (never: first), the request
        with the longest cached prefix plus aging."""
        best, best_key = None, None
        for seq in self.waiting:
            cached = self._cached_length(seq) if self._reuses(seq) else 0
            if self._inflight_would_help(seq, cached):
                continue
            key = (self._turns.get(seq.client, -1), -(cached + self.config.aging_tokens * seq.waited_steps))
            if best_key is None or key < best_key:
                best, best_key = seq, key
        return best

    def _forget_idle_clients(self) -> None:
        """Drop the turns of clients with nothing waiting or running (now and then: the table is
        small next to the queue)."""
        if len(self._turns) > 2 * (len(self.waiting) + len(self.running)) + 16:
            active = {s.client for s in self.waiting} | {s.client for s in self.running}
            self._turns = {c: n for c, n in self._turns.items() if c in active}

    def _reuses(self, seq: Sequence) -> bool:
        """Whether seq may start from a cached prefix (scoring needs logits at every position)."""
        return self.config.prefix_cache and not seq.prompt_logits

    def _cached_length(self, seq: Sequence) -> int:
        """How much of seq's prompt the cache holds (memoized within a step; see __init__)."""
        hit = self._cached_memo.get(seq.id)
        if hit is not None and hit[0] == self.tree.version:
            return hit[1]
        n = self.tree.match_length(seq.tokens[:-1])
        self._cached_memo[seq.id] = (self.tree.version, n)
        return n

    def _inflight_would_help(self, seq: Sequence, cached: int) -> bool:
        """A running prefill shares at least a page more of this prompt than the cache holds."""
        if not self._reuses(seq):
            return False
        need = cached + self.pool.page_size
        if need > len(seq.tokens):  # no prefix of seq is that long
            return False
        for r in self.running:
            if not r.in_prefill:
                continue
            key = (r.id, seq.id)
            common = self._common_memo.get(key)
            if common is None:
                common = self._common_memo[key] = common_prefix(r.tokens, seq.tokens)
            if common >= need:
                return True
        return False

    def _admit(self, seq: Sequence, plan: Plan, budget: _Budget, planned: set[int]) -> bool:
        match = self.tree.match(seq.tokens[:-1] if self._reuses(seq) else [])
        self.pool.retain(match.pages)
        seq.pages, seq.n_computed = list(match.pages), match.length
        self._pin_used(seq, match.node, len(match.pages))
        if seq.preemptions == 0:
            seq.n_cache_hit = match.length
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status, seq.admitted_at = Status.RUNNING, self.step_no
        n_copies = len(plan.copies)
        if self._plan(seq, plan, budget, planned, may_preempt=False):  # admitting never preempts
            self.n_admissions += 1
            self._turns[seq.client] = self.n_admissions
            return True
        # no room after all: undo (seq computed nothing; its pages, copies included, go back)
        del plan.copies[n_copies:]
        seq.n_computed = 0
        self._to_waiting(seq, front=True)
        return False

    # ---- after the step ----
    def complete(self, plan: Plan) -> None:
        """The step ran: advance each sequence and cache the prompt chunks just computed (a
        sequence that finished meanwhile, after an ahead step was launched, is left as it is)."""
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.status is not Status.RUNNING:
                continue
            seq.n_computed += chunk.n - len(chunk.draft)  # a draft's kept tokens count once verified
            if chunk.start < seq.n_prompt and self.config.prefix_cache:
                self._cache(seq)

    def _cache(self, seq: Sequence) -> None:
        node = self.tree.insert(seq.tokens[:seq.n_computed], seq.pages)
        self._pin_used(seq, node, len(seq.pages))

    def drop_unused_pages(self, seq: Sequence) -> None:
        """After a draft's verification: the pages past seq's next position (they held only
        rejected tokens; nothing else references them) go back to the pool."""
        keep = self.pool.pages_for(seq.n_computed + 1)
        if len(seq.pages) > keep:
            self.pool.release(seq.pages[keep:])
            del seq.pages[keep:]

    # ---- leaving ----
    def finish(self, seq: Sequence, reason: str) -> None:
        """Done (or cancelled): computed tokens stay in the prefix cache; pages are released."""
        if seq.status is Status.RUNNING:
            self._release(seq)
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def preempt(self, seq: Sequence) -> None:
        self._to_waiting(seq, front=True)
        seq.preemptions += 1
        self.n_preemptions += 1

    def _to_waiting(self, seq: Sequence, front: bool) -> None:
        self._release(seq)
        self.running.remove(seq)
        seq.status, seq.n_computed = Status.WAITING, 0
        self.waiting.insert(0 if front else len(self.waiting), seq)

    def _release(self, seq: Sequence) -> None:
        if seq.n_computed > 0 and self.config.prefix_cache:
            self.tree.insert(seq.tokens[:seq.n_computed], seq.pages)
        if seq.node is not None:
            self.tree.unpin(seq.node)
            seq.node = None
        self.pool.release(seq.pages)
        seq.pages = []

