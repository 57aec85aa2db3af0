"""A limit on a sequence's reasoning: once it has written `tokens` tokens inside its reasoning
block without closing it, the tokens of the closing marker are forced (appended without
sampling), so the reply moves on to its answer."""
from __future__ import annotations

from dataclasses import dataclass

TAIL = 256  # characters of recent text kept to find a marker split across tokens


@dataclass(frozen=True, slots=True)
class ThinkingBudget:
    tokens: int  # reasoning tokens allowed (0: the block is closed at once)
    close: tuple[int, ...]  # the ids forced to close the block
    start: str = ""  # the text that opens the block ("": the prompt opened it)
    end: str = ""  # the text that closes it (the model may close it itself)

    def __post_init__(self):
        if self.tokens < 0 or not self.close or not self.end:
            raise ValueError(f"a thinking budget of {self.tokens} tokens closing with {self.close} / {self.end!r}")


class BudgetWatch:
    """One sequence's reasoning so far, token by token (`see` each token's text)."""

    __slots__ = ("budget", "tail", "inside", "used", "done")

    def __init__(self, budget: ThinkingBudget):
        self.budget = budget
        self.tail = ""
        self.inside = not budget.start
        self.used = 0
        self.done = False

    def due(self) -> tuple[int, ...]:
        """The ids to force now: the closing marker where the budget is spent, else none."""
        if self.done or not self.inside or self.used < self.budget.tokens or self._closing():
            return ()
        self.done = True
        return self.budget.close

    def _closing(self) -> bool:
        """Whether the text ends in the start of the closing marker (the model is closing it now)."""
        end = self.budget.end
        return any(self.tail.endswith(end[:k]) for k in range(1, len(end)))

    def see(self, text: str) -> None:
        """Record one appended token's text."""
        if self.done:
            return
        self.tail = (self.tail + text)[-TAIL:]
        if not self.inside:
            k = self.tail.find(self.budget.start)
            if k >= 0:
                self.inside, self.tail = True, self.tail[k + len(self.budget.start):]
            return
        if self.budget.end in self.tail:
            self.done = True
            return
        self.used += 1
