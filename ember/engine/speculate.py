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
from p without it is drawing from p).

How long a draft is: each sequence estimates the chances that a draft's first token and its later
ones are kept (`Acceptance`, from its drafts so far, every sequence's before it has any), the
engine measures what drafted rows add to a decode step (`StepCosts`), and a step's drafts are cut
to the length that gives (nearly) the most expected tokens per second of the step; none where that
is not GAIN_MARGIN better than no draft (free text that does not repeat). Within that, a draft is
at most twice as long as the last one wholly kept, and one more than twice what was kept of one
partly kept.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .draftmodel import DraftAsk, DraftModel
from .drafts import NgramIndex, PromptLookup
from .radix import RadixCache
from .sequence import Sequence, Status

SOURCES = ("cache", "lookup", "draft")
# llama-server's names for its modes, and what they are here
ALIASES = {"ngram-simple": "lookup", "ngram-map-k": "lookup", "ngram-map-k4v": "lookup", "ngram-mod": "lookup",
           "ngram-cache": "cache", "draft-simple": "draft", "none": ""}
# a sequence's first drafts are at most this long, then they grow while kept (twice as long as the
# last one wholly kept, one more than twice what was kept of one partly kept)
FIRST_SIZE = 3
MAX_PAUSE = 32  # longest pause, in steps, after draft-model steps that drafted nothing
# the chance that a drafted token is kept before any draft tells (as PRIOR_WEIGHT drafts or tokens)
PRIOR_KEEP, PRIOR_WEIGHT = 0.5, 2.0
# most evidence a sequence's estimates hold (first tokens of drafts, later tokens): older drafts count less
EVIDENCE_DRAFTS, EVIDENCE = 16.0, 64.0
IDLE_DECAY = 0.97  # a step without a draft: the evidence fades, so that drafting is tried again
# a sequence with less evidence than this (drafts) tries one drafted token where it has one: ~1 in
# 23 steps of text that does not repeat (a rejected token costs ~a quarter of a step there)
PROBE_BELOW = 0.5
# the same for a draft's later tokens: a sequence with less evidence of them than this (tokens) whose
# last draft was wholly kept verifies one token more than it (drafts of one token tell nothing of
# later ones, so an estimate that stopped drafts at one would never learn otherwise)
PROBE_LATER_BELOW = 4.0
# a decode step of n rows (one sequence and n - 1 drafted tokens) over one of one row, where steps
# are not measured to cost less (SmolLM2-135M Q4_1 on 2 CPU threads, quiet, 4.3 ms a row at an
# 800-token context; its products take rows in vector lanes, up to 16 tokens a pass over the weights,
# so a second pass starts at 17: bench/spec_steps.py's sweep, two runs, 2026-12-05); past the
# table, a row adds PRIOR_ROW_COST
PRIOR_STEP = (1.0, 1.2, 1.46, 1.63, 1.85, 2.2, 2.36, 2.55, 2.76, 2.95, 3.2, 3.43, 3.76, 4.08, 4.29, 4.5, 5.26,
              5.56, 5.86, 6.16, 6.37, 6.57, 6.77, 7.0, 7.21, 7.41, 7.59, 7.78, 8.07, 8.35, 8.63, 8.88, 9.15)
PRIOR_ROW_COST = 0.27
# a step is drafted only where its expected tokens per second beat the undrafted step's by this much
# (what the estimates may be off by, and the host's work on drafts)
GAIN_MARGIN = 1.1
NEAR_BEST = 0.97  # drafts are as long as give at least this share of the best expected gain
COST_EMA = 0.2  # weight of a new measurement of a step size's time


AUTO = ("cache", "lookup")  # `--spec-type auto` (the command line's default): these, where steps run one at a time


def is_auto(text: str) -> bool:
    """Whether a `--spec-type` text asks for `auto`."""
    return text.strip() == "auto"


def parse_types(text: str) -> tuple[str, ...]:
    """`--spec-type`: a comma-separated list of sources (llama-server's names accepted); `auto`
    is AUTO (SpecConfig.auto says where it holds)."""
    if is_auto(text):
        return AUTO
    out = []
    for name in (s.strip() for s in text.split(",") if s.strip()):
        name = ALIASES.get(name, name)
        if name and name not in SOURCES:
            known = ", ".join(("none", "auto") + SOURCES + tuple(k for k in ALIASES if k != "none"))
            raise ValueError(f"unknown speculative type {name!r} (known: {known})")
        if name and name not in out:
            out.append(name)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DraftParams:
    """A request's own limits (llama-server's `speculative.n_max`, `n_min`, `p_min`)."""

    n_max: int = 32  # most tokens drafted a step (0: never)
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
    # the types hold only where the engine computes a step at a time: where it launches decode steps
    # ahead of their predecessors' results (a GPU), drafts would stop that, and only `draft` is kept
    auto: bool = False

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
        return replace(self, types=types, model=model)

    def for_engine(self, decodes_ahead: bool) -> "SpecConfig":
        """The config an engine uses: an `auto` one keeps only `draft` where decode steps are
        launched ahead (speculation without a draft model is measured not to slow decoding down
        only where steps run one at a time, bench/NOTES.md)."""
        if not (self.auto and decodes_ahead):
            return self
        return replace(self, types=tuple(t for t in self.types if t == "draft"))


class Acceptance:
    """Drafted tokens kept, in two counts: a draft's first token (kept or not, once a draft), and
    its later ones given the one before was kept (kept, and the first rejected). Drafts are kept
    in runs (a copied stretch is kept to its end, and lost where the text parts from what it
    copies), so a later token is kept more often than a first one. Recent drafts count most: at
    most `drafts` first tokens and `tokens` later ones of evidence."""

    __slots__ = ("first", "later", "drafts", "tokens")

    def __init__(self, drafts: float = EVIDENCE_DRAFTS, tokens: float = EVIDENCE):
        self.first = [0.0, 0.0]  # kept, tried
        self.later = [0.0, 0.0]
        self.drafts, self.tokens = drafts, tokens

    @classmethod
    def of_all(cls) -> "Acceptance":
        """Counts of every sequence's drafts: four times one sequence's evidence."""
        return cls(4 * EVIDENCE_DRAFTS, 4 * EVIDENCE)

    @property
    def tried(self) -> float:
        return self.first[1]

    def add(self, drafted: int, accepted: int) -> None:
        _count(self.first, int(accepted > 0), 1, self.drafts)
        if accepted:
            _count(self.later, accepted - 1, accepted - 1 + (accepted < drafted), self.tokens)

    def fade(self, factor: float) -> None:
        for c in (self.first, self.later):
            c[0] *= factor
            c[1] *= factor

    def rate(self, prior: tuple[float, float]) -> tuple[float, float]:
        """The chances that a draft's first token is kept, and a later one given the one before it
        was (`prior`: before there is evidence, as PRIOR_WEIGHT drafts or tokens)."""
        return tuple((c[0] + PRIOR_WEIGHT * q) / (c[1] + PRIOR_WEIGHT) for c, q in zip((self.first, self.later), prior))


def _count(c: list[float], kept: float, tried: float, limit: float) -> None:
    c[0] += kept
    c[1] += tried
    if c[1] > limit:
        c[0] *= limit / c[1]
        c[1] = limit


class DraftState:
    """One sequence's drafting: its limits, the length its drafts may have now, the chance that a
    drafted token is kept, and its counts."""

    __slots__ = ("params", "size", "pause", "misses", "drafted", "accepted", "lookup", "source", "own", "shared",
                 "whole")

    def __init__(self, params: DraftParams, shared: Acceptance | None = None):
        self.params = params
        self.size = min(params.n_max, FIRST_SIZE)
        self.pause = 0  # steps left without drafting (after draft-model steps that drafted nothing)
        self.misses = 0  # such steps in a row
        self.drafted = self.accepted = 0  # llama-server's timings: draft_n, draft_n_accepted
        self.own = Acceptance()  # this sequence's drafts
        self.shared = shared if shared is not None else Acceptance.of_all()  # every sequence's
        self.lookup = PromptLookup()
        self.source = ""  # where the draft being verified came from (metrics.DRAFT_SOURCES)
        self.whole = 0  # the last draft's length if it was wholly kept, else 0

    def room(self) -> int:
        """How many tokens to look for a draft of this step (0: none)."""
        if self.pause:
            self.pause -= 1
            return 0
        return self.size

    def keep_rate(self) -> tuple[float, float]:
        """The chances that a draft's first token is kept and a later one (Acceptance.rate): this
        sequence's drafts, before them every sequence's (a new request of a session drafts as its
        earlier ones were kept)."""
        return self.own.rate(self.shared.rate((PRIOR_KEEP, PRIOR_KEEP)))

    def probing(self) -> bool:
        """Whether this sequence has no recent evidence of its own (then a draft token is tried
        whatever the estimate: without drafts there is nothing to estimate from)."""
        return self.own.tried < PROBE_BELOW

    def stretch(self, n: int, found: int) -> int:
        """`n` tokens of a found draft to verify, or one more than the last draft where that was
        wholly kept and this sequence has little evidence of later tokens (PROBE_LATER_BELOW)."""
        if 0 < n <= self.whole and self.own.later[1] < PROBE_LATER_BELOW:
            return min(found, self.whole + 1)
        return n

    def record(self, drafted: int, accepted: int) -> None:
        """A verified draft: counted, then adapt()."""
        self.drafted += drafted
        self.accepted += accepted
        self.adapt(drafted, accepted)

    def adapt(self, drafted: int, accepted: int) -> None:
        """Longer drafts after wholly kept ones, shorter after partly kept ones; the evidence of
        the chances that drafted tokens are kept (this sequence's, every sequence's)."""
        self.whole = drafted if accepted == drafted else 0
        if accepted == drafted:
            self.size = min(self.params.n_max, 2 * self.size)
        else:
            self.size = max(1, min(self.size, 2 * accepted + 1))
        self.own.add(drafted, accepted)
        self.shared.add(drafted, accepted)
        self.misses = 0

    def idle(self) -> None:
        """A step without a draft: older evidence counts less."""
        self.own.fade(IDLE_DECAY)

    def missed(self) -> None:
        """A draft model's step that drafted nothing (it was not sure enough of even the first
        token): it cost about what a drafted row does, so the pause doubles while such steps go on."""
        self.misses += 1
        self.pause = min(MAX_PAUSE, 1 << (self.misses - 1))


class StepCosts:
    """What drafted rows add to a decode step, measured as steps run: for a step of `base` decoding
    sequences, the time of an undrafted one (a moving average), and per number of drafted rows the
    drafted step's time over it. Ratios, not times, so that they hold as contexts grow; counts not
    measured yet are interpolated, and past the largest measured count follow the prior's shape from
    it (a count measured low must not look cheaper than the longer drafts never tried: drafts would
    stay that long); none costs more than the prior (PRIOR_STEP) says, so that a loaded machine's
    slow steps do not stop drafting where it pays."""

    def __init__(self):
        self._plain: dict[int, float] = {}  # base -> seconds of an undrafted step
        self._ratio: dict[int, dict[int, float]] = {}  # base -> {drafted rows: time / undrafted time}

    def measured(self, base: int, drafted: int, seconds: float) -> None:
        if not drafted:
            old = self._plain.get(base)
            self._plain[base] = seconds if old is None else old + COST_EMA * (seconds - old)
            return
        plain = self._plain.get(base)
        if plain is None:
            return
        ratios = self._ratio.setdefault(base, {})
        ratio, old = seconds / plain, ratios.get(drafted)
        if old is None and ratios:  # a new count starts from what the others say of it
            old = self._estimate(base, drafted)
        if old is None:
            ratios[drafted] = ratio
        else:  # one slow step (the machine's, not the rows') moves the estimate a little only: a count
            # that came out slow once would otherwise never be tried again to correct it
            ratios[drafted] = old + COST_EMA * (min(max(ratio, 0.8 * old), 1.25 * old) - old)

    def relative(self, base: int, drafted: int) -> float:
        """A step of `base` decoding sequences and `drafted` more rows, over one without them: as
        measured (interpolated between measured counts), at most the prior's."""
        if not drafted:
            return 1.0
        return min(self._estimate(base, drafted), _prior(base + drafted) / _prior(base))

    def _estimate(self, base: int, drafted: int) -> float:
        """relative() before the prior's cap."""
        prior = _prior(base + drafted) / _prior(base)
        ratios = self._ratio.get(base, {})
        if drafted in ratios:
            return ratios[drafted]
        below = max((n for n in ratios if n < drafted), default=0)
        above = min((n for n in ratios if n > drafted), default=None)
        low = ratios.get(below, 1.0)
        if above is None:  # past the measured counts: the prior's shape from the largest of them
            return low * prior / (_prior(base + below) / _prior(base))
        return low + (ratios[above] - low) * (drafted - below) / (above - below)


def _prior(rows: int) -> float:
    """The prior's time of a decode step of `rows` rows, in one-row steps."""
    if rows <= len(PRIOR_STEP):
        return PRIOR_STEP[rows - 1]
    return PRIOR_STEP[-1] + PRIOR_ROW_COST * (rows - len(PRIOR_STEP))


def draft_lengths(rates: list[tuple[float, float]], found: list[int], base: int, costs: StepCosts) -> list[int]:
    """How many tokens of each sequence's draft to verify in a step of `base` decoding sequences:
    `found[i]` tokens drafted for a sequence whose draft's first token is kept with chance
    `rates[i][0]`, each later one given the one before with `rates[i][1]`. Drafted tokens join the step in order of
    their chance of being kept, as many as give (nearly) the most expected tokens per second, and
    none unless that beats the step without drafts by GAIN_MARGIN."""
    chances = sorted(((first * later ** j, i) for i, ((first, later), n) in enumerate(zip(rates, found))
                      for j in range(n)), reverse=True)
    gains, tokens = [1.0], float(base)
    for m, (chance, _) in enumerate(chances, 1):
        tokens += chance
        gains.append(tokens / base / costs.relative(base, m))
    best = max(gains)
    if best < GAIN_MARGIN:
        return [0] * len(found)
    # the longest within NEAR_BEST of the best: where gains are flat, the estimates (a chance fitted
    # to drafts that are kept in runs, costs that leave out the step's own overheads) favour short
    n = max(m for m, g in enumerate(gains) if g >= NEAR_BEST * best)
    out = [0] * len(found)
    for _, i in chances[:n]:
        out[i] += 1
    return out


class Speculator:
    """Proposes each decoding sequence's draft before a step is planned; learns from finished
    sequences (the shared n-gram index)."""

    def __init__(self, config: SpecConfig, tree: RadixCache, n_ctx: int, drafter: DraftModel | None = None):
        if ("draft" in config.types) != (drafter is not None):
            raise ValueError("speculative type draft needs a draft model, and a draft model that type")
        self.config, self.tree, self.n_ctx, self.drafter = config, tree, n_ctx, drafter
        self.index = NgramIndex(int(config.index_mb * 2**20)) if "cache" in config.types else None
        self.costs = StepCosts()
        self.kept = Acceptance.of_all()  # every sequence's drafts: a new sequence's first estimate

    @property
    def enabled(self) -> bool:
        return bool(self.config.types)

    def state_for(self, params: DraftParams | None) -> DraftState | None:
        """A new sequence's drafting state (None: it drafts nothing)."""
        params = params or self.config.draft
        return DraftState(params, self.kept) if self.enabled and params.n_max > 0 else None

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
        found = []
        for (seq, st, _), (source, draft) in zip(wants, self._find_all(wants)):
            st.source = source
            found.append(self._allowed(seq, draft))
        decoding = sum(1 for s in running if s.status is Status.RUNNING and s.n_pending == 1)
        lengths = draft_lengths([st.keep_rate() for _, st, _ in wants], [len(d) for d in found],
                                max(decoding, 1), self.costs)
        any_draft = False
        for (seq, st, _), draft, n in zip(wants, found, lengths):
            if not n and draft and st.probing() and not st.params.n_min:
                n = 1
            n = st.stretch(n, len(draft))
            if n >= max(1, st.params.n_min):
                seq.draft = draft[:n]
                any_draft = True
            else:
                st.idle()
        return any_draft

    def measured(self, plan, seconds: float) -> None:
        """A step ran in `seconds`: its time joins the step costs where every chunk of it decodes
        (a prompt chunk's step says nothing of what drafted rows cost)."""
        if self.enabled and plan.chunks and all(c.n - len(c.draft) == 1 for c in plan.chunks):
            self.costs.measured(len(plan.chunks), sum(len(c.draft) for c in plan.chunks), seconds)

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
