"""Decode ahead: the next greedy decode step launched before the host has read the one before it.

Where every running sequence decodes in a step and keeps decoding after it whatever token it
gets, nothing waits for admission and no request or cancellation has come in, the next step is
each sequence one position on, its token the greedy choice from its best ids of this step. On a
backend that chains tokens the device makes that choice itself (get_rows from the best ids it
left behind); elsewhere the host makes it once this step has run (the same bookkeeping, for
tests). The host's work on this step's results (choosing, appending, texts, events, the next
schedule) then overlaps the device's on the next. A sequence this step ends after all (an
end-of-generation token, a stop string, a cancellation) has its row of the next step dropped;
its cache slot there lies past what it computed.
"""
from __future__ import annotations

from ..models.base import TopLogits
from .runner import Ahead, Launched, ModelRunner
from .scheduler import Plan, Scheduler
from .sequence import Status


class DecodeAhead:
    """The engine's one door to ahead steps: `follow` launches the step after a launched one where
    it can, `take` hands it over as the engine's next step."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, n_ctx: int, enabled: bool):
        self.scheduler, self.runner = scheduler, runner
        self.n_ctx, self.enabled = n_ctx, enabled
        self._next: Launched | None = None

    @property
    def pending(self) -> bool:
        return self._next is not None

    def take(self) -> Launched | None:
        """The step launched ahead by the last `follow`, if any (the engine's step now)."""
        step, self._next = self._next, None
        return step

    def drop(self) -> None:
        self._next = None

    def follow(self, step: Launched, quiet: bool) -> bool:
        """Launch the step after `step` (greedy: top_k > 0) where it can run before `step`'s results
        are read; quiet: nothing came in from callers. True when it did. Where the host makes the
        choice, `step` is waited for and its results copied first: the next run overwrites them."""
        if not (self.enabled and step.top_k and quiet) or self.scheduler.waiting or step.plan.copies:
            return False
        picked = self._continuing(step.plan)
        if picked is None:
            return False
        rows, bans = picked
        nxt = self.scheduler.plan_ahead([step.plan.chunks[i] for i in rows])
        if nxt is None:
            return False
        prev = None
        if not self.runner.chains:
            out = self.runner.wait(step)
            step.out = prev = TopLogits(out.ids.copy(), out.values.copy())
        self._next = self.runner.launch(nxt, step.top_k, Ahead(step.top_k, rows, bans, prev))
        return True

    def _continuing(self, plan: Plan) -> tuple[list[int], list[list[int]]] | None:
        """The rows of the plan's sequences that go on after it and their banned ids; None where the
        step after cannot be planned now (a prompt chunk, prompt logits, or a running sequence
        outside the plan)."""
        rows, bans, ending = [], [], 0
        for i, c in enumerate(plan.chunks):
            seq = c.seq
            if seq.status is not Status.RUNNING:
                continue  # ended by the step before this one (itself ahead)
            if c.n != 1 or c.logit_rows != [c.start] or len(seq.tokens) != c.start + 1 or seq.prompt_logits:
                return None
            if seq.max_new_tokens <= c.start + 2 - seq.n_prompt or c.start + 2 >= self.n_ctx:
                ending += 1  # this step's token is its last (length): nothing to compute after it
                continue
            rows.append(i)
            bans.append(sorted(seq.owner.sampler.banned))
        if not rows or len(rows) + ending != len(self.scheduler.running):
            return None
        return rows, bans
