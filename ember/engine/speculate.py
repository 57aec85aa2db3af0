"""Speculative decoding: a decoding sequence's step computes its pending token and a few drafted
tokens after it, and keeps as many of the drafted ones as the model itself would have chosen.

Drafts come from what was written before (drafts.py): the prefix cache's path past the whole
context (`cache`), the shared n-gram index over every finished sequence (`cache`), the request's
own prompt and output (`lookup`); or from a second, smaller model of the same vocabulary (`draft`,
draftmodel.py), which drafts for all sequences at once. The scheduler puts a draft into the
sequence's chunk of the step (scheduler.py), the model computes every position causally as it
does a prompt chunk, and output.py chooses a token from each row in turn exactly as without a
draft, keeping draft tokens while they match: greedy requests get exactly greedy output, sampled ones the same distribution
(a draft is a point distribution: accepting it with probability p(token) and otherwise drawing
from p without it is drawing from p). Each sequence's draft length adapts to how much of its
drafts is kept, and it stops drafting for a while after drafts that were mostly rejected.
"""
from __future__ import annotations

from dataclasses import dataclass

from .draftmodel import DraftAsk, DraftModel
from .drafts import NgramIndex, PromptLookup
from .radix import RadixCache
from .sequence import Sequence, Status

SOURCES = ("cache", "lookup", "draft")
# llama-server's names for its modes, and what they are here
ALIASES = {"ngram-simple": "lookup", "ngram-map-k": "lookup", "ngram-map-k4v": "lookup", "ngram-mod": "lookup",
           "ngram-cache": "cache", "draft-simple": "draft", "none": ""}
# a sequence's first drafts are at most this long, then they grow with acceptance (on a CPU a chunk of
# up to 4 rows still streams the weights once, as a decode does: longer ones cost more per row)
FIRST_SIZE = 3
MAX_PAUSE = 32  # longest pause, in steps, after drafts that were mostly rejected
# a draft of which less than 1/MISS_SHARE is kept is a miss: on a CPU a drafted row costs about a
# fifth of a decode step, so such a draft costs more than the steps it saves
MISS_SHARE = 4


def parse_types(text: str) -> tuple[str, ...]:
    """`--spec-type`: a comma-separated list of sources (llama-server's names accepted)."""
    out = []
    for name in (s.strip() for s in text.split(",") if s.strip()):
        name = ALIASES.get(name, name)
        if name and name not in SOURCES:
            known = ", ".join(("none",) + SOURCES + tuple(k for k in ALIASES if k != "none"))
            raise ValueError(f"unknown speculative type {name!r} (known: {known})")
        if name and name not in out:
            out.append(name)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DraftParams:
    """A request's own limits (llama-server's `speculative.n_max`, `n_min`, `p_min`)."""

    n_max: int = 16  # most tokens drafted a step (0: never)
    n_min: int = 0  # a shorter draft is not worth a step's extra rows: none then
    p_min: float = 0.75  # the draft model's least probability for a drafted token (the n-gram sources have none)

    def __post_init__(self):
        if not 0 <= self.n_max <= 256:
            raise ValueError(f"speculative n_max must be in 0..256, got {self.n_max}")
        if not 0 <= self.n_min <= max(self.n_max, 0):
            raise ValueError(f"speculative n_min must be in 0..n_max ({self.n_max}), got {self.n_min}")
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"speculative p_min must be in [0, 1], got {self.p_min}")


@dataclass(frozen=True, slots=True)
class DraftModelConfig:
    """The draft model (llama-server's --model-draft, --device-draft, --ctx-size-draft)."""

    path: str  # GGUF file or known model name
    device: str | None = None  # its backend (None: the model's own)
    n_ctx: int | None = None  # longest sequence it drafts for (None: the model's context)

    def __post_init__(self):
        if not self.path:
            raise ValueError("the draft model needs a file")
        if self.n_ctx is not None and self.n_ctx < 16:
            raise ValueError(f"the draft model's context must be at least 16 tokens, got {self.n_ctx}")


@dataclass(frozen=True, slots=True)
class SpecConfig:
    types: tuple[str, ...] = ()  # draft sources, tried in this order; () = no speculation
    draft: DraftParams = DraftParams()  # defaults for requests that set none
    index_mb: float = 64.0  # the shared n-gram index's size
    model: DraftModelConfig | None = None  # the draft model (source `draft`)

    def __post_init__(self):
        bad = [t for t in self.types if t not in SOURCES]
        if bad:
            raise ValueError(f"unknown speculative types {bad} (known: {', '.join(SOURCES)})")
        if self.index_mb < 0:
            raise ValueError(f"the n-gram index size must be >= 0 MB, got {self.index_mb}")
        if ("draft" in self.types) != (self.model is not None):
            raise ValueError("speculative type draft needs a draft model (--model-draft)" if self.model is None
                             else "a draft model is used by speculative type draft: add it to the types")

    def with_model(self, model: DraftModelConfig | None) -> "SpecConfig":
        """This config with a draft model, drafting first (as llama-server does given --model-draft)."""
        if model is None:
            return self
        types = self.types if "draft" in self.types else ("draft",) + self.types
        return SpecConfig(types, self.draft, self.index_mb, model)


class DraftState:
    """One sequence's drafting: its limits, the length its drafts may have now, and its counts."""

    __slots__ = ("params", "size", "pause", "misses", "drafted", "accepted", "lookup", "source")

    def __init__(self, params: DraftParams):
        self.params = params
        self.size = min(params.n_max, FIRST_SIZE)
        self.pause = 0  # steps left without drafting
        self.misses = 0  # drafts wholly rejected in a row
        self.drafted = self.accepted = 0  # llama-server's timings: draft_n, draft_n_accepted
        self.lookup = PromptLookup()
        self.source = ""  # where the draft being verified came from (metrics.DRAFT_SOURCES)

    def room(self) -> int:
        """How many tokens to draft this step (0: none)."""
        if self.pause:
            self.pause -= 1
            return 0
        return self.size

    def record(self, drafted: int, accepted: int) -> None:
        """A verified draft: counted, then adapt()."""
        self.drafted += drafted
        self.accepted += accepted
        self.adapt(drafted, accepted)

    def adapt(self, drafted: int, accepted: int) -> None:
        """Longer drafts after wholly kept ones, shorter after partly kept ones, and after one that
        was mostly rejected a pause (doubling while such drafts go on)."""
        if accepted == drafted:
            self.size = min(self.params.n_max, 2 * self.size)
        else:
            self.size = max(1, min(self.size, 2 * accepted + 1))
        if accepted * MISS_SHARE >= drafted:
            self.misses = 0
            return
        self.missed()

    def missed(self) -> None:
        """A draft mostly rejected, or a draft model's step that drafted nothing (it was not sure
        enough of even the first token): the pause doubles while such steps go on."""
        self.misses += 1
        self.pause = min(MAX_PAUSE, 1 << (self.misses - 1))


class Speculator:
    """Proposes each decoding sequence's draft before a step is planned; learns from finished
    sequences (the shared n-gram index)."""

    def __init__(self, config: SpecConfig, tree: RadixCache, n_ctx: int, drafter: DraftModel | None = None):
        if ("draft" in config.types) != (drafter is not None):
            raise ValueError("speculative type draft needs a draft model, and a draft model that type")
        self.config, self.tree, self.n_ctx, self.drafter = config, tree, n_ctx, drafter
        self.index = NgramIndex(int(config.index_mb * 2**20)) if "cache" in config.types else None

    @property
    def enabled(self) -> bool:
        return bool(self.config.types)

    def state_for(self, params: DraftParams | None) -> DraftState | None:
        """A new sequence's drafting state (None: it drafts nothing)."""
        params = params or self.config.draft
        return DraftState(params) if self.enabled and params.n_max > 0 else None

    def propose(self, running: list[Sequence]) -> bool:
        """Set seq.draft for each decoding sequence that has one now; True if any did."""
        wants: list[tuple[Sequence, DraftState, int]] = []
        for seq in running:
            seq.draft = []
            st = seq.owner.spec if seq.owner is not None else None
            if st is None or seq.status is not Status.RUNNING or seq.n_pending != 1 or seq.n_generated == 0:
                continue
            room = min(st.room(), seq.max_new_tokens - seq.n_generated - 1, self.n_ctx - len(seq.tokens) - 1)
            if room >= max(1, st.params.n_min):
                wants.append((seq, st, room))
        any_draft = False
        for (seq, st, _), (source, draft) in zip(wants, self._find_all(wants)):
            st.source = source
            draft = self._allowed(seq, draft)
            if len(draft) >= max(1, st.params.n_min):
                seq.draft = draft
                any_draft = True
        return any_draft

    def would_draft(self, running: list[Sequence]) -> bool:
        """Whether some running sequence may draft at its next step (then steps are not launched
        ahead of their predecessors' results: a draft needs the token chosen before it)."""
        return any(s.owner is not None and s.owner.spec is not None and not s.owner.spec.pause for s in running)

    def _find_all(self, wants: list[tuple[Sequence, DraftState, int]]) -> list[tuple[str, list[int]]]:
        """Each sequence's draft and its source: the sources in the order configured, the first with
        a draft; the draft model drafts at once for every sequence that gets that far; the shared
        index (with `cache`) last."""
        types = self.config.types
        cut = types.index("draft") if "draft" in types else len(types)
        found = [self._find(seq, st, room, types[:cut]) for seq, st, room in wants]
        if self.drafter is not None:
            asks = [DraftAsk(seq, room, st.params.p_min) for (seq, st, room), f in zip(wants, found) if not f[1]]
            drafts = self.drafter.draft(asks) if asks else {}
            for i, (seq, st, room) in enumerate(wants):
                if not found[i][1]:
                    draft = drafts.get(seq.id)
                    if not draft:  # the draft model's step cost as much as a drafted one: a miss
                        st.missed()
                    found[i] = ("draft", draft) if draft else self._find(seq, st, room, types[cut + 1:])
        if self.index is not None:
            for i, (seq, _, room) in enumerate(wants):
                if not found[i][1]:
                    found[i] = ("index", self.index.find(seq.tokens, room))
        return found

    def _find(self, seq: Sequence, st: DraftState, room: int, types: tuple[str, ...]) -> tuple[str, list[int]]:
        """The first of the n-gram sources `types` with a draft (the cache's own path, the
        request's tokens), and the draft."""
        for source in types:
            if source == "cache":
                draft = self.tree.continuation(seq.tokens, room)
                source = "tree"
            else:
                draft = st.lookup.find(seq.tokens, room)
            if draft:
                return source, draft
        return "", []

    @staticmethod
    def _allowed(seq: Sequence, draft: list[int]) -> list[int]:
        """The part of the draft the request's grammar accepts (the whole draft without one)."""
        matcher = seq.owner.matcher
        if matcher is None or not draft:
            return draft
        probe = matcher.fork()
        for i, token in enumerate(draft):
            if not probe.accept_token(token):
                return draft[:i]
        return draft

    def finished(self, seq: Sequence) -> None:
        """A sequence ended: its tokens join the shared index (the part not cached before it)."""
        if self.index is not None and not seq.prompt_logits:
            self.index.add(seq.tokens, seq.n_cache_hit)
        if self.drafter is not None:
            self.drafter.finished(seq)

    def clear(self) -> None:
        if self.index is not None:
            self.index.clear()
        if self.drafter is not None:
            self.drafter.clear()
