"""A step's results, sequence by sequence: tokens chosen, texts, stop strings, events.

For every sequence whose last token a step computed, its row of logits is sampled (or, where the
step brought back only each row's best ids, the greedy choice is made from them); the token is
appended, its text decoded and searched for stop strings, and its event put in the outbox. A
sequence ends here: at an end-of-generation token, a stop string, its length, or an error of its own.

On a device that runs a step while the host goes on, the text and event of a greedy token that
nothing about it can end (no stop strings, no log-probabilities) are made later (`flush_later`):
after the next step is launched, while the device computes it.
"""
from __future__ import annotations

import time

import numpy as np

from ..sampler import NonFiniteLogits, Sampler, SamplingError
from .budget import BudgetWatch
from .metrics import EngineMetrics
from .requests import FinishEvent, Outbox, ProgressEvent, PromptEvent, Request, RequestHandle, TokenEvent
from .scheduler import Chunk, Plan, Scheduler
from .sequence import Sequence, Status
from .speculate import DraftState, Speculator
from .stops import StopMatcher

MAX_DEVICE_BEST = 64  # most best-token candidates per row brought back instead of the whole row


class SeqOutput:
    """What a sequence needs besides scheduling: its request, sampler, text decoder, stop strings
    and grammar, and its timings."""

    __slots__ = ("handle", "index", "request", "sampler", "decoder", "stops", "matcher", "budget", "spec",
                 "started_at", "first_token_at", "last_token_at", "progress_sent")

    def __init__(self, handle: RequestHandle, index: int, request: Request, sampler: Sampler, decoder, matcher,
                 spec: DraftState | None = None):
        self.handle, self.index, self.request = handle, index, request
        self.sampler, self.decoder, self.matcher = sampler, decoder, matcher
        self.spec = spec  # drafting state (speculative decoding), None where the sequence drafts nothing
        # the stop strings' search; it holds back text that may be the start of one
        self.stops = StopMatcher(request.stop) if request.stop else None
        self.budget = BudgetWatch(request.thinking_budget) if request.thinking_budget else None
        self.started_at = 0.0  # first admission (0: not yet admitted)
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.progress_sent = -1  # prompt tokens the last ProgressEvent said were processed

    def best_needed(self) -> int:
        """How many of a row's best ids suffice to choose the token (0: the whole row)."""
        if self.matcher is not None or self.request.logprobs is not None or self.budget is not None:
            return 0
        return self.sampler.best_needed


class Output:
    """Turns steps' results into tokens and events, and ends sequences."""

    def __init__(self, scheduler: Scheduler, tokenizer, metrics: EngineMetrics, n_ctx: int, device_top_k: bool,
                 speculator: Speculator | None = None):
        self.scheduler, self.metrics, self.n_ctx = scheduler, metrics, n_ctx
        self.speculator = speculator
        self.eog_ids = tokenizer.eog_ids
        self.device_top_k = device_top_k  # the backend reduces rows to their best ids (top_k)
        self.outbox = Outbox()
        # tokens chosen and appended whose text and event are still to make (flush_later), one a sequence
        self.later: dict[Sequence, int] = {}
        self._mask: np.ndarray | None = None  # grammar masks, reused

    # ---- before a step ----
    def best_needed(self, plan: Plan) -> int:
        """k > 0 when every sequence of the step needs only its rows' k best tokens (greedy, no
        grammar, no logit changes but bans, no log-probabilities) and the backend can find them on
        the device: then only token ids cross to the host instead of rows of vocabulary size."""
        if not self.device_top_k:
            return 0
        k = 1
        for c in plan.chunks:
            if c.seq.prompt_logits:
                return 0
            if c.logit_rows:
                need = c.seq.owner.best_needed()
                if not 0 < need <= MAX_DEVICE_BEST:
                    return 0
                k = max(k, need)
        return k

    def planned(self, plan: Plan) -> None:
        """Count the prompt tokens the step computes; a sequence admitted for the first time counts
        what the cache served, and its prompt's progress starts."""
        m = self.metrics
        for c in plan.chunks:
            seq, st = c.seq, c.seq.owner
            if c.start < seq.n_prompt:
                m.prompt_tokens_computed += min(c.n, seq.n_prompt - c.start)
            if not st.started_at:
                st.started_at = time.perf_counter()
                m.prompt_tokens += seq.n_prompt
                m.prompt_tokens_cached += seq.n_cache_hit
                self._progress(seq, c.start)
        m.preemptions = self.scheduler.n_preemptions

    # ---- after a step ----
    def postprocess(self, plan: Plan, logits, best_only: bool = False) -> None:
        """Each sequence's tokens from the step's results. best_only: `logits` holds each row's best
        token ids and their logits (TopLogits, (n_rows, k) each, best first), not whole rows."""
        row = 0
        if best_only:  # ids as Python ints, in one call; whether each row's best logit is finite
            best, usable = logits.ids.tolist(), np.isfinite(logits.values[:, 0]).tolist()
        for chunk in plan.chunks:
            seq = chunk.seq
            n_rows = len(chunk.logit_rows)
            row += n_rows
            if seq.status is Status.FINISHED:  # ended after this step (ahead) was launched: its row is dropped
                continue
            if chunk.start < seq.n_prompt:
                self._prompt_done(seq, chunk, logits[row - n_rows:row] if seq.prompt_logits else None)
            if seq.n_computed == len(seq.tokens):  # the last token was computed: its logits are in row - 1
                if not seq.wants_sample:
                    self.finish(seq, "length")
                elif not n_rows:
                    raise AssertionError("a sequence to sample from has no row of logits in its step")
                elif chunk.draft:
                    first = row - n_rows
                    if best_only:
                        self._verify(seq, chunk.draft, lambda i: self._choose_best(seq, best[first + i],
                                                                                   usable[first + i], later=False))
                    else:
                        self._verify(seq, chunk.draft, lambda i: self._sample(seq, logits[first + i]))
                elif best_only:
                    self._choose_best(seq, best[row - 1], usable[row - 1])
                else:
                    self._sample(seq, logits[row - 1])

    def _verify(self, seq: Sequence, draft: list[int], choose) -> None:
        """A drafted chunk's rows in turn: `choose(i)` picks the token after position i of the chunk
        as without a draft; draft tokens are kept (their KV is computed) while they are the ones picked."""
        st, kept = seq.owner.spec, 0
        st.drafted += len(draft)  # counted first: the sequence may end on one of the rows (its timings)
        for i in range(len(draft) + 1):
            n = len(seq.tokens)
            choose(i)
            if seq.status is not Status.RUNNING or i == len(draft) or len(seq.tokens) != n + 1 \
                    or seq.tokens[n] != draft[i]:
                break
            seq.n_computed += 1
            kept += 1
            st.accepted += 1
        st.adapt(len(draft), kept)
        self.metrics.count_draft(st.source, len(draft), kept)
        if seq.status is Status.RUNNING:
            self.scheduler.drop_unused_pages(seq)

    def _prompt_done(self, seq: Sequence, chunk: Chunk, rows: np.ndarray | None) -> None:
        """A chunk of the prompt is computed: its logits' reduction (scoring), its progress."""
        st = seq.owner
        if rows is not None:
            positions = np.asarray(chunk.logit_rows, np.int64)
            keep = positions < seq.n_prompt
            if keep.any():
                self.outbox.put(st.handle, PromptEvent(st.index, st.request.prompt_reduce(rows[keep], positions[keep])))
        self._progress(seq, min(chunk.start + chunk.n, seq.n_prompt))

    def _progress(self, seq: Sequence, processed: int) -> None:
        """A ProgressEvent, for requests that want them, where the prompt got further than told."""
        st = seq.owner
        if st.request.progress and processed > st.progress_sent:
            st.progress_sent = processed
            seconds = time.perf_counter() - st.started_at
            self.outbox.put(st.handle, ProgressEvent(st.index, seq.n_prompt, seq.n_cache_hit, processed, seconds))

    def _choose_best(self, seq: Sequence, ids: list[int], usable: bool, later: bool = True) -> None:
        """The greedy choice from a row's best ids: none where the row had no finite best logit, or
        fewer comparable logits than banned ids before them (NaN logits come back as id -1)."""
        try:
            token = seq.owner.sampler.choose_from_best(ids) if usable else -1
        except SamplingError as e:
            self._fail_sampling(seq, e)
            return
        if token < 0:
            self._fail_sampling(seq, NonFiniteLogits("the model produced non-finite logits (NaN/inf)"))
            return
        self._append(seq, token, None, later=later)

    def _sample(self, seq: Sequence, row: np.ndarray) -> None:
        st, req = seq.owner, seq.owner.request
        if st.budget is not None and self._close_thinking(seq):
            return
        try:
            token = st.sampler.sample(row, self._allowed(st))
        except SamplingError as e:
            self._fail_sampling(seq, e)
            return
        if st.matcher is not None and not st.matcher.accept_token(token):
            self.finish(seq, "error", error=f"the grammar rejected token {token} it had allowed")
            return
        lp = st.sampler.logprobs(token, n=req.logprobs) if req.logprobs is not None else None
        if not self._append(seq, token, lp) or st.matcher is None or req.logprobs is not None:
            return
        # Tokens the grammar leaves no choice about are appended now, without sampling, and computed
        # together in the next step (no log-probabilities for them: requests that want those skip this).
        for forced in st.matcher.forced_tokens(limit=min(64, seq.max_new_tokens - seq.n_generated)):
            if not st.matcher.accept_token(forced) or not self._append(seq, forced, None):
                return
            self.metrics.forced_tokens += 1

    def _close_thinking(self, seq: Sequence) -> bool:
        """Where the reasoning budget is spent, its closing marker is appended instead of a sampled
        token (the row goes unused); True if it was. A grammar that has begun and refuses the
        marker keeps the choice (the row is sampled)."""
        st = seq.owner
        close = st.budget.due()
        if not close or (st.matcher is not None and not st.matcher.accept_token(close[0])):
            return False
        for i, token in enumerate(close):
            if i and st.matcher is not None and not st.matcher.accept_token(token):
                return True
            if not self._append(seq, token, None):
                return True
            self.metrics.forced_tokens += 1
        return True

    def _fail_sampling(self, seq: Sequence, e: SamplingError) -> None:
        """This sequence ends with the error; the others go on."""
        self.finish(seq, "error", error=str(e), code=e.code)

    def _allowed(self, st: SeqOutput) -> np.ndarray | None:
        """The grammar's mask of allowed tokens (packed bits), or None without a grammar."""
        if st.matcher is None:
            return None
        n_words = st.matcher.vocab.n_words
        if self._mask is None or self._mask.shape[0] != n_words:
            self._mask = np.empty(n_words, np.uint32)
        st.matcher.fill_mask(self._mask)
        return self._mask

    def _append(self, seq: Sequence, token: int, lp, later: bool = False) -> bool:
        """Append a chosen token and send it; False when the sequence finished with it. later: the
        token's text and event may be made after the next step is launched (flush_later), where
        nothing about them can end the sequence (no stop strings, no log-probabilities)."""
        st = seq.owner
        st.sampler.accept(token)
        self._time_token(seq, time.perf_counter())
        if token in self.eog_ids:
            self.finish(seq, "stop")
            return False
        seq.tokens.append(token)
        self.metrics.generated_tokens += 1
        at_length = not seq.wants_sample or len(seq.tokens) >= self.n_ctx
        if later and not st.request.stop and lp is None and not at_length:
            self.later[seq] = token
            return True
        self._event(seq, token, lp)
        if seq.status is Status.FINISHED:
            return False
        if at_length:
            self.finish(seq, "length")
            return False
        return True

    def flush_later(self) -> None:
        """The texts and events of tokens _append left for later, in the order they were chosen."""
        later, self.later = self.later, {}
        for seq, token in later.items():
            self._event(seq, token, None)

    def _event(self, seq: Sequence, token: int, lp) -> None:
        """A chosen token's text and event; a stop string in the text ends the sequence."""
        st = seq.owner
        piece = st.decoder.feed(token)
        if st.budget is not None:
            st.budget.see(piece)
        text, stopped = st.stops.feed(piece) if st.stops is not None else (piece, False)
        top = list(zip(lp.top_ids, lp.top_logprobs)) if lp and st.request.logprobs else None
        self.outbox.put(st.handle, TokenEvent(st.index, token, text, lp.logprob if lp else None, top))
        if stopped:
            self.finish(seq, "stop", flush=False)  # whatever follows the stop string is dropped

    def _time_token(self, seq: Sequence, now: float) -> None:
        st, m = seq.owner, self.metrics
        if st.first_token_at == 0.0:
            st.first_token_at = now
            ttft = now - st.handle.submitted
            (m.ttft_hit if 2 * seq.n_cache_hit >= seq.n_prompt else m.ttft_miss).observe(ttft)
        else:
            m.inter_token.observe(now - st.last_token_at)
        st.last_token_at = now

    # ---- ending ----
    def finish(self, seq: Sequence, reason: str, error: str | None = None, flush: bool = True,
               code: str | None = None) -> None:
        """End a sequence; `flush` sends the text still held back (incomplete UTF-8, stop-string candidates)."""
        if seq.status is Status.FINISHED:
            return
        token = self.later.pop(seq, None)
        if token is not None:  # its last token's text and event come first
            self._event(seq, token, None)
            if seq.status is Status.FINISHED:
                return
        self.metrics.requests_finished += 1  # counted before anyone can see the sequence gone
        self.scheduler.finish(seq, reason)
        if self.speculator is not None:
            self.speculator.finished(seq)
        st = seq.owner
        tail = ((st.stops.flush() if st.stops is not None else "") + st.decoder.flush()) if flush else ""
        drafted, kept = (st.spec.drafted, st.spec.accepted) if st.spec is not None else (0, 0)
        self.outbox.put(st.handle, FinishEvent(st.index, reason, tail, seq.n_prompt, seq.n_cache_hit,
                                               seq.n_generated, error, code, drafted, kept))

    def finish_cancelled(self) -> None:
        sched = self.scheduler
        for seq in [s for s in sched.running + sched.waiting if s.cancelled]:
            self.metrics.requests_cancelled += 1  # before the sequence is seen to leave
            self.finish(seq, "cancelled")

    def hand_over(self) -> None:
        """Every event made so far to its caller, the later ones included."""
        self.flush_later()
        self.outbox.deliver()
