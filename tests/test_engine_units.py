"""Page pool, prefix tree and scheduler, without a model."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from ember.engine.pages import OutOfPages, PagePool
from ember.engine.radix import RadixCache, common_prefix
from ember.engine.scheduler import Plan, Scheduler, SchedulerConfig
from ember.engine.sequence import Sequence, Status


def check_refs(pool: PagePool, tree: RadixCache, seqs=()) -> None:
    """Every page's reference count equals the references the tree and the sequences hold."""
    expected = Counter()
    stack = [tree.root]
    while stack:
        node = stack.pop()
        expected.update(node.pages)
        stack.extend(node.children.values())
    for s in seqs:
        expected.update(s.pages)
    assert [expected[p] for p in range(pool.n_pages)] == pool.refs
    assert pool.n_free == sum(1 for r in pool.refs if r == 0)


# ---- page pool ----

def test_pool_allocates_and_frees():
    pool = PagePool(3, 4)
    pages = [pool.allocate() for _ in range(3)]
    assert sorted(pages) == [0, 1, 2] and pool.n_free == 0
    with pytest.raises(OutOfPages):
        pool.allocate()
    pool.retain([pages[0]])
    assert pool.shared(pages[0]) and pool.release([pages[0]]) == 0
    assert pool.release(pages) == 3 and pool.n_free == 3
    with pytest.raises(ValueError, match="released more often"):
        pool.release([pages[0]])
    assert pool.pages_for(0) == 0 and pool.pages_for(4) == 1 and pool.pages_for(5) == 2


# ---- prefix tree ----

def fill(pool: PagePool, n_tokens: int) -> list[int]:
    return [pool.allocate() for _ in range(pool.pages_for(n_tokens))]


def test_insert_match_and_split_share_pages():
    pool = PagePool(32, 4)
    tree = RadixCache(pool)
    a = list(range(10))
    pages_a = fill(pool, 10)
    tree.insert(a, pages_a)
    pool.release(pages_a)  # the sequence leaves; the tree keeps them
    check_refs(pool, tree)
    assert tree.match_length(a + [99]) == 10
    assert tree.match_length([0, 1, 2, 7]) == 3
    m = tree.match([0, 1, 2, 3, 4, 5, 50])  # splits the edge after 6 tokens (mid-page)
    assert m.length == 6 and m.pages == pages_a[:2]
    check_refs(pool, tree)
    assert pool.refs[pages_a[1]] == 2  # the page of the cut is listed by both halves
    assert tree.n_tokens == 10


def test_branch_page_tables_use_their_own_boundary_page():
    pool = PagePool(32, 4)
    tree = RadixCache(pool)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 9, 9]
    pa = fill(pool, len(a))
    tree.insert(a, pa)
    pb = pa[:1] + [pool.allocate()]  # b shares the first page; copied the second (diverges at 5)
    pool.retain(pa[:1])
    tree.insert(b, pb)
    assert tree.page_table(tree.match(b).node) == pb
    assert tree.page_table(tree.match(a).node) == pa
    pool.release(pa)
    pool.release(pb)
    check_refs(pool, tree)


def test_eviction_is_lru_and_respects_pins():
    pool = PagePool(8, 4)
    tree = RadixCache(pool)
    seqs = {}
    for first in (10, 20, 30):
        toks = [first] * 8
        pages = fill(pool, 8)
        tree.insert(toks, pages)
        pool.release(pages)
        seqs[first] = toks
    assert pool.n_free == 2
    tree.match(seqs[10])  # 10 is now the most recent
    pinned = tree.match(seqs[20]).node
    tree.pin(pinned)
    freed = tree.evict(2)
    assert freed == 2 and tree.match_length(seqs[30]) == 0  # oldest unpinned went first
    assert tree.evict(10) == 2 and tree.match_length(seqs[10]) == 0
    assert tree.match_length(seqs[20]) == 8  # pinned survives
    tree.unpin(pinned)
    tree.clear()
    assert pool.n_free == 8 and tree.n_tokens == 0
    check_refs(pool, tree)


def test_random_inserts_keep_refcounts_exact():
    rng = random.Random(0)
    pool = PagePool(400, 4)
    tree = RadixCache(pool)
    for _ in range(200):
        toks = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
        m = tree.match(toks)
        pages = list(m.pages)
        pool.retain(pages)
        # extend like a sequence: copy the shared boundary page, allocate the rest
        P = pool.page_size
        for idx in range(m.length // P, pool.pages_for(len(toks))):
            new = pool.allocate() if pool.n_free else None
            if new is None:
                tree.evict(4)
                new = pool.allocate()
            if idx < len(pages):
                pool.release([pages[idx]])
                pages[idx] = new
            else:
                pages.append(new)
        tree.insert(toks, pages)
        pool.release(pages)
        check_refs(pool, tree)
        assert tree.match_length(toks) == len(toks)
    tree.clear()
    assert pool.n_free == pool.n_pages


# ---- scheduler ----

def make(n_pages=64, page=4, **cfg):
    pool = PagePool(n_pages, page)
    tree = RadixCache(pool)
    return pool, tree, Scheduler(pool, tree, SchedulerConfig(**cfg))


def run_step(sched: Scheduler, plan: Plan, sample=lambda seq: 7) -> None:
    """What the engine does after a forward: advance, then sample for rows that complete."""
    sched.complete(plan)
    for c in plan.chunks:
        s = c.seq
        if s.status is Status.RUNNING and s.n_computed == len(s.tokens):
            if s.wants_sample:
                s.tokens.append(sample(s))
            if not s.wants_sample:
                sched.finish(s, "length")


def test_budget_decode_first_and_chunked_prefill():
    pool, tree, sched = make(max_batch_tokens=8, max_seqs=4)
    a = Sequence(list(range(100, 120)), max_new_tokens=3)
    sched.add(a)
    plan = sched.schedule()
    assert [(c.seq, c.start, c.n) for c in plan.chunks] == [(a, 0, 8)] and plan.chunks[0].logit_rows == []
    run_step(sched, plan)
    b = Sequence([1, 2, 3], max_new_tokens=2)
    sched.add(b)
    plan = sched.schedule()  # a continues its prefill, b gets the rest of the budget? a takes 8
    assert plan.n_tokens <= 8
    while sched.has_work:
        plan = sched.schedule()
        assert plan.n_tokens <= 8
        decodes = [c for c in plan.chunks if not c.seq.in_prefill]
        assert plan.chunks[:len(decodes)] == decodes  # decode tokens come first
        run_step(sched, plan)
    assert a.n_generated == 3 and b.n_generated == 2
    assert pool.n_free + sum(1 for r in pool.refs if r) == pool.n_pages
    check_refs(pool, tree)


def test_admission_prefers_longest_cached_prefix_with_aging():
    pool, tree, sched = make(max_seqs=1, aging_tokens=4)
    shared = list(range(40))
    first = Sequence(shared + [1], max_new_tokens=1)
    sched.add(first)
    while sched.has_work:
        run_step(sched, sched.schedule())
    cold = Sequence([999] * 10, max_new_tokens=1)
    sched.add(cold)
    order = []
    for i in range(60):  # a warm request (40 cached tokens) arrives every step
        sched.add(Sequence(shared + [500 + i, i], max_new_tokens=1))
        plan = sched.schedule()
        order += [c.seq for c in plan.chunks if c.start == c.seq.n_cache_hit]
        run_step(sched, plan)
    assert order[0] is not cold and order[0].n_cache_hit == 40  # longest cached prefix first...
    # ...but aging (4 tokens a step) lets the cold one in once it has waited ~40 / 4 steps
    assert cold in order and order.index(cold) <= 12


def test_in_flight_prefix_is_computed_once():
    pool, tree, sched = make(n_pages=200, max_batch_tokens=16, max_seqs=8)
    system = list(range(1000, 1064))
    seqs = [Sequence(system + [i], max_new_tokens=1) for i in range(4)]
    for s in seqs:
        sched.add(s)
    computed = 0
    while sched.has_work:
        plan = sched.schedule()
        computed += plan.n_tokens
        run_step(sched, plan)
    # 65 tokens for the first, then the others reuse the 64-token system prompt
    assert computed <= 65 + 3 * 2 + 4
    assert sorted(s.n_cache_hit for s in seqs) == [0, 64, 64, 64]


def test_preemption_when_pages_run_out_then_resume():
    pool, tree, sched = make(n_pages=12, page=4, max_batch_tokens=64, max_seqs=3)
    seqs = [Sequence([i] * 10, max_new_tokens=10) for i in range(3)]  # 20 tokens each, 5 pages
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_work:
        run_step(sched, sched.schedule())
        check_refs(pool, tree, sched.running)
        steps += 1
        assert steps < 500
    assert all(s.n_generated == 10 for s in seqs)
    assert sched.n_preemptions >= 1
    tree.clear()
    assert pool.n_free == pool.n_pages


def test_cancel_waiting_and_running():
    pool, tree, sched = make(max_seqs=1)
    a, b = Sequence([1, 2, 3], 50), Sequence([4, 5], 50)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())
    sched.finish(a, "cancelled")
    sched.finish(b, "cancelled")
    assert not sched.has_work and a.status is b.status is Status.FINISHED
    tree.clear()
    assert pool.n_free == pool.n_pages


def add_request(sched: Scheduler, rng: random.Random, prefixes: list, tail: int, max_new: int) -> Sequence:
    """A request of one of the shared prefixes and a random tail (1 .. tail-1 tokens), queued."""
    s = Sequence(rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, tail))],
                 max_new_tokens=rng.randrange(1, max_new))
    sched.add(s)
    return s


def cancel_one_maybe(sched: Scheduler, rng: random.Random, live: list) -> None:
    """With probability 0.05, cancel a random request of `live` that has not finished."""
    if live and rng.random() < 0.05:
        victim = rng.choice(live)
        if victim.status is not Status.FINISHED:
            sched.finish(victim, "cancelled")


def test_random_workload_invariants():
    rng = random.Random(1)
    pool, tree, sched = make(n_pages=40, page=4, max_batch_tokens=32, max_seqs=6)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(5, 40))] for _ in range(4)]
    live = []
    for step in range(600):
        if rng.random() < 0.3 and len(sched.waiting) < 20:
            live.append(add_request(sched, rng, prefixes, 20, 30))
        cancel_one_maybe(sched, rng, live)
        run_step(sched, sched.schedule(), sample=lambda s: rng.randrange(50))
        check_refs(pool, tree, sched.running)
        assert sum(1 for s in sched.running) <= 6
    while sched.has_work:
        run_step(sched, sched.schedule())
    assert all(s.status is Status.FINISHED for s in live)
    tree.clear()
    assert pool.n_free == pool.n_pages


class Unremembered(Scheduler):
    """The admission lookups computed afresh every time (what the memos of Scheduler stand for)."""

    def _cached_length(self, seq):
        return self.tree.match_length(seq.tokens[:-1])

    def _inflight_would_help(self, seq, cached):
        return self._reuses(seq) and any(
            r.in_prefill and common_prefix(r.tokens, seq.tokens) >= cached + self.pool.page_size for r in self.running)


def test_admission_memos_change_no_decision():
    """The same random workload (shared prefixes, preemption, eviction, cancellations) through a
    scheduler with and without the per-step memos of cached lengths and common prefixes: every
    step's plan is the same."""
    plans = []
    for cls in (Scheduler, Unremembered):
        rng = random.Random(4)
        pool = PagePool(30, 4)
        tree = RadixCache(pool)
        sched = cls(pool, tree, SchedulerConfig(max_batch_tokens=24, max_seqs=8))
        prefixes = [[rng.randrange(50) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
        live, trace = [], []
        for step in range(400):
            for _ in range(rng.randrange(3) if step < 300 else 0):
                live.append(add_request(sched, rng, prefixes, 12, 20))
            cancel_one_maybe(sched, rng, live)
            plan = sched.schedule()
            trace.append(([(c.seq.id - live[0].id, c.start, c.n, tuple(c.logit_rows)) for c in plan.chunks],
                          list(plan.copies), sched.n_preemptions))
            run_step(sched, plan, sample=lambda s: rng.randrange(50))
        plans.append(trace)
        assert sched.n_preemptions > 0 and any(t[1] for t in trace)  # the workload preempts and copies
    assert plans[0] == plans[1]


def test_decode_fast_path_plans_what_the_general_rule_plans():
    """_plan takes a shortcut for a decode token: on random sequence states and budgets, the chunk it
    plans is the one the general rule (_chunk) gives, and the running order's key is the
    in_prefill rule."""
    from ember.engine.scheduler import _Budget, _running_order

    pool, _, sched = make(n_pages=64)
    rng = random.Random(5)
    decodes = 0
    for _ in range(5000):
        n_prompt = rng.randint(1, 6)
        tokens = list(range(n_prompt + rng.randint(0, 4)))
        seq = Sequence(tokens[:n_prompt], max_new_tokens=rng.randint(0, 6), prompt_logits=rng.random() < 0.2)
        seq.tokens = tokens
        seq.n_computed = rng.randint(0, len(tokens) - 1)
        seq.admitted_at = rng.randint(0, 9)
        assert _running_order(seq) == (seq.in_prefill, seq.admitted_at)
        tokens_left, rows_left = rng.randint(1, 3), rng.randint(0, 2)
        want = sched._chunk(seq, _Budget(tokens_left, rows_left))
        plan = Plan()
        planned = sched._plan(seq, plan, _Budget(tokens_left, rows_left), set(), may_preempt=False)
        assert planned == (want[0] > 0)
        if planned:
            (chunk,) = plan.chunks
            assert (chunk.start, chunk.n, chunk.logit_rows) == (seq.n_computed, *want)
            decodes += want == (1, [seq.n_computed]) and seq.n_generated > 0 and not seq.prompt_logits
        pool.release(seq.pages)
    assert decodes > 300


# ---- running out of pages: every sequence that fits the pool finishes ----

def check_pins(sched: Scheduler) -> None:
    """A running sequence pins only cached pages it uses itself (at the same places), so whatever no
    running sequence uses is evictable."""
    P = sched.pool.page_size
    for s in sched.running:
        for n in sched.tree.path(s.node) if s.node is not None else []:
            first = n.start // P
            assert s.pages[first:first + len(n.pages)] == n.pages


def drain(sched: Scheduler, max_steps: int, sample=lambda seq: 7) -> int:
    """Steps until nothing is left; every step with work computes something (a step that plans nothing
    while sequences wait for pages only the cache or they themselves hold would repeat forever)."""
    steps = 0
    while sched.has_work:
        plan = sched.schedule()
        assert plan.chunks, f"step {steps}: nothing planned; running {[(s.n_computed, len(s.tokens), s.pages) for s in sched.running]}"
        run_step(sched, plan, sample)
        check_pins(sched)
        check_refs(sched.pool, sched.tree, sched.running)
        steps += 1
        assert steps <= max_steps
    return steps


@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("batch", [5, 512])
def test_a_sequence_as_long_as_the_pool_finishes(page, batch):
    """One sequence whose prompt and generation fill the whole pool (the prompt's cached boundary page
    is the one the sequence's last page needs): it finishes with every token, for every prompt length,
    for chunked prefills whose chunks end mid-page, and after a request that left a prefix in the cache."""
    pool_tokens = 64
    for n_prompt in range(1, pool_tokens):
        for warm in (False, True):
            pool, tree, sched = make(n_pages=pool_tokens // page, page=page, max_batch_tokens=batch, max_seqs=1)
            prompt = [(i * 7) % 50 for i in range(n_prompt)]
            if warm:  # an earlier request leaves part of this prompt (ending mid-page) in the cache
                sched.add(Sequence(prompt[:max(1, n_prompt // 2 + 1)] + [98], max_new_tokens=3))
                drain(sched, 200, sample=lambda s: 99)
            seq = Sequence(list(prompt), max_new_tokens=pool_tokens - n_prompt)
            sched.add(seq)
            drain(sched, 200)
            assert seq.finish_reason == "length" and seq.n_generated == pool_tokens - n_prompt
            tree.clear()
            assert pool.n_free == pool.n_pages


def test_pages_a_sequence_copied_away_from_are_evictable_while_it_runs():
    """A sequence that starts from a cached prefix ending mid-page copies that page before writing to
    it; the cache's original is no longer pinned by it, so eviction can take it at once."""
    pool, tree, sched = make(n_pages=8, page=4)
    first = Sequence([1, 2, 3, 4, 5, 6], max_new_tokens=1)
    sched.add(first)
    drain(sched, 20)
    seq = Sequence([1, 2, 3, 4, 5, 6, 7, 8], max_new_tokens=4)  # 6 tokens cached: page 1 is half full
    sched.add(seq)
    run_step(sched, sched.schedule())
    assert seq.n_cache_hit == 6 and seq.status is Status.RUNNING
    cached = set(tree.page_table(tree.match([1, 2, 3, 4, 5, 6]).node))
    copied_from = cached - set(seq.pages)
    assert len(copied_from) == 1
    check_pins(sched)
    free_before = pool.n_free
    assert tree.evict(pool.n_pages) >= 1 and pool.n_free > free_before
    assert copied_from <= set(pool._free)
    check_refs(pool, tree, sched.running)
    drain(sched, 20)
    assert seq.n_generated == 4


def test_running_sequences_that_each_need_a_page_all_finish():
    """Several sequences decode at once, each as long as half the pool or more: whenever one needs a
    page, the cache is evicted and younger ones are preempted; each finishes with all its tokens and
    the waiting ones are admitted in turn."""
    pool, tree, sched = make(n_pages=8, page=4, max_batch_tokens=16, max_seqs=4)
    seqs = [Sequence([i, i + 1, i + 2], max_new_tokens=14 + 5 * (i % 3)) for i in range(7)]
    for s in seqs:
        sched.add(s)
    drain(sched, 2000)
    assert all(s.finish_reason == "length" and s.n_generated == s.max_new_tokens for s in seqs)
    assert sched.n_preemptions > 0
    tree.clear()
    assert pool.n_free == pool.n_pages


def test_random_tight_pool_always_progresses():
    """Random requests sharing prefixes (mid-page boundaries, copies, splits), some as long as the whole
    pool, cancellations, a small pool and odd chunk sizes: every step computes something, pins cover
    only used pages, reference counts stay exact, and everything finishes."""
    for seed in range(6):
        rng = random.Random(100 + seed)
        page = rng.choice([2, 3, 4, 8])
        n_pages = rng.randrange(3, 12)
        pool, tree, sched = make(n_pages=n_pages, page=page, max_batch_tokens=rng.choice([1, 3, 7, 64]),
                                 max_seqs=rng.randrange(1, 5), max_logit_rows=rng.choice([1, 2, 64]))
        cap = n_pages * page
        prefixes = [[rng.randrange(20) for _ in range(rng.randrange(1, cap - 1))] for _ in range(3)]
        live = []
        for step in range(300):
            if rng.random() < 0.3 and len(sched.waiting) < 10:
                base = rng.choice(prefixes)[:rng.randrange(1, cap)]
                prompt = base + [rng.randrange(20) for _ in range(rng.randrange(0, 3))]
                prompt = prompt[:cap - 1]
                s = Sequence(prompt, max_new_tokens=rng.randrange(1, cap - len(prompt) + 1))
                sched.add(s)
                live.append(s)
            cancel_one_maybe(sched, rng, live)
            plan = sched.schedule()
            assert plan.chunks or not sched.has_work
            run_step(sched, plan, sample=lambda s: rng.randrange(20))
            check_pins(sched)
            check_refs(pool, tree, sched.running)
        drain(sched, 5000, sample=lambda s: rng.randrange(20))
        assert all(s.status is Status.FINISHED for s in live)
        assert all(s.n_generated == s.max_new_tokens for s in live if s.finish_reason == "length")
        tree.clear()
        assert pool.n_free == pool.n_pages


# ---- fairness between clients ----

def admissions(sched: Scheduler, steps: int) -> list[Sequence]:
    """The sequences in the order they are admitted (first chunk at their cached length)."""
    order = []
    for _ in range(steps):
        plan = sched.schedule()
        order += [c.seq for c in plan.chunks if c.start == c.seq.n_cache_hit and c.seq not in order]
        run_step(sched, plan)
    return order


def test_one_clients_queue_does_not_starve_another():
    """Client a queues 200 requests; client b's one request, queued after them, is admitted as soon
    as a slot frees, not after a's 200."""
    pool, tree, sched = make(n_pages=64, max_seqs=1)
    flood = [Sequence([1, 2, i], max_new_tokens=2, client="a") for i in range(200)]
    for s in flood:
        sched.add(s)
    first = admissions(sched, 1)
    single = Sequence([3, 4, 5], max_new_tokens=2, client="b")
    sched.add(single)
    order = first + admissions(sched, 12)
    assert order[:3] == [flood[0], single, flood[1]]


def test_clients_take_turns_and_each_keeps_its_own_order():
    """Three clients with 6, 3 and 1 queued requests and two slots: admissions go round the clients
    (a, b, c, a, b, a, b, a, ...); a client's own requests keep their order of preference (cached prefix
    first); a client that comes back after its queue emptied goes before those served since."""
    pool, tree, sched = make(n_pages=128, max_seqs=2)
    warm = Sequence(list(range(40, 60)) + [0], max_new_tokens=1, client="w")
    sched.add(warm)
    admissions(sched, 4)
    a = [Sequence([10, i, i], max_new_tokens=3, client="a") for i in range(5)]
    a.append(Sequence(list(range(40, 60)) + [9], max_new_tokens=3, client="a"))  # 20 cached tokens
    b = [Sequence([20, i, i], max_new_tokens=3, client="b") for i in range(3)]
    c = [Sequence([30, 1, 1], max_new_tokens=3, client="c")]
    for s in a + b + c:
        sched.add(s)
    order = admissions(sched, 60)
    assert [s.client for s in order] == list("abcababaaa")
    assert order[0] is a[5]  # a's request with a cached prefix goes first among a's
    assert [s for s in order if s.client == "b"] == b
    late = Sequence([40, 1, 1], max_new_tokens=3, client="c")
    for i in range(4):
        sched.add(Sequence([10, 50 + i, 1], max_new_tokens=3, client="a"))
    sched.add(late)
    assert admissions(sched, 3)[0] is late


def test_the_table_of_turns_stays_small():
    """Clients that have nothing queued or running are forgotten (a server meets many)."""
    pool, tree, sched = make(n_pages=64, max_seqs=2)
    for i in range(500):
        sched.add(Sequence([1, 2, 3], max_new_tokens=1, client=f"client-{i}"))
        admissions(sched, 2)
        assert len(sched._turns) <= 2 * (len(sched.waiting) + len(sched.running)) + 17
    assert not sched.has_work
