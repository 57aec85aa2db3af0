"""One sequence's scheduling state: its tokens, how many have KV, and the pages holding it."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from .radix import Node

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    tokens: list[int]  # prompt, then generated tokens
    max_new_tokens: int
    prompt_logits: bool = False  # prompt positions need logits (scoring)...
    prompt_logits_from: int = 0  # ...from this one on
    owner: Any = None  # what the engine attaches (sampler, output channel...)
    client: str = ""  # who asked (admission takes turns between clients)
    id: int = field(default_factory=lambda: next(_ids))
    n_prompt: int = 0
    status: Status = Status.WAITING
    n_computed: int = 0  # leading tokens whose KV is in `pages`
    pages: list[int] = field(default_factory=list)  # page table; one reference held on each
    node: Node | None = None  # pinned prefix-tree node
    n_cache_hit: int = 0  # prompt tokens found in the prefix cache at (first) admission
    waited_steps: int = 0
    admitted_at: int = -1  # engine step of the latest admission (youngest = largest)
    preemptions: int = 0
    cancelled: bool = False
    draft: list[int] = field(default_factory=list)  # tokens guessed to follow the pending one (speculate.py)
    finish_reason: str | None = None

    def __post_init__(self):
        if not self.tokens:
            raise ValueError("a sequence needs at least one token")
        self.n_prompt = len(self.tokens)

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def n_pending(self) -> int:
        """Tokens not yet computed (a running sequence always has at least one, but a draft model's
        between its drafts: draftmodel.py)."""
        return len(self.tokens) - self.n_computed

    @property
    def in_prefill(self) -> bool:
        return self.n_pending > 1 or self.n_generated == 0

    @property
    def wants_sample(self) -> bool:
        return self.max_new_tokens > self.n_generated
