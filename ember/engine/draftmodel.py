"""A draft model: a second, smaller model of the same vocabulary that guesses the target's next tokens.

It runs on the engine's own machinery, apart from the target's: a page pool, KV cache, prefix
tree, scheduler and model runner of its own (its layers and widths differ from the target's, so
its pages cannot be the target's). Each drafting sequence of the target has a shadow sequence
here whose tokens follow the target's. A draft round, before the target's step is planned:

1. every shadow is rolled back to what the target has kept (the tokens both agree on; the pages
   past them go back to the pool) and given the tokens the target chose since;
2. one draft step computes those catch-up tokens of all shadows at once (a new shadow's prompt
   comes from the draft's prefix tree where it can, as the target's does);
3. then, all shadows at once, a step per draft token: each takes its greedy token while the
   draft's probability for it is at least the request's p_min, until it has the length asked for.

The last drafted token is never computed here (the target's verification decides whether it is
kept); a shadow between rounds has nothing pending, so the scheduler leaves it out of steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..models import Model, ModelError
from .pages import PagePool
from .radix import RadixCache, common_prefix
from .runner import ModelRunner
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Sequence

# llama.cpp's rule for a draft model's vocabulary: sizes within this many tokens, token texts
# equal from this id on (the first few ids are control tokens that families number alike but name apart)
VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_ID = 5


def check_vocab(target: dict, draft: dict, n_target: int, n_draft: int) -> None:
    """ModelError unless the draft's vocabulary (from its GGUF metadata) is the target's: the same
    tokenizer type, special tokens, sizes within VOCAB_MAX_SIZE_DIFFERENCE and token texts."""
    key = "tokenizer.ggml.model"
    if target.get(key) != draft.get(key):
        raise ModelError(f"the draft model's vocabulary type is {draft.get(key)!r}, the model's {target.get(key)!r}: "
                         "a draft model needs the model's vocabulary")
    for name in ("bos_token_id", "eos_token_id", "add_bos_token", "add_eos_token"):
        key = f"tokenizer.ggml.{name}"
        if target.get(key) != draft.get(key):
            raise ModelError(f"the draft model's {key} is {draft.get(key)!r}, the model's {target.get(key)!r}: "
                             "a draft model needs the model's special tokens")
    if abs(n_target - n_draft) > VOCAB_MAX_SIZE_DIFFERENCE:
        raise ModelError(f"the draft model has {n_draft} tokens, the model {n_target}: a draft model's vocabulary "
                         f"may differ in size by at most {VOCAB_MAX_SIZE_DIFFERENCE}")
    a, b = target.get("tokenizer.ggml.tokens") or [], draft.get("tokenizer.ggml.tokens") or []
    n = min(n_target, n_draft, len(a), len(b))
    if a[VOCAB_CHECK_START_ID:n] != b[VOCAB_CHECK_START_ID:n]:
        i = next(i for i in range(VOCAB_CHECK_START_ID, n) if a[i] != b[i])
        raise ModelError(f"token {i} is {b[i]!r} in the draft model, {a[i]!r} in the model: a draft model needs "
                         "the model's vocabulary")


@dataclass(frozen=True, slots=True)
class DraftAsk:
    """One sequence's part in a draft round: at most `n` tokens, each with the draft's probability
    at least `p_min`."""

    seq: Sequence  # the target's sequence
    n: int
    p_min: float


class _Shadow:
    """A target sequence's counterpart here: `seq` holds the target's tokens the draft has seen
    (`synced` of them, all kept by the target) and after them the ones it drafted."""

    __slots__ = ("seq", "synced", "ask", "draft", "done")

    def __init__(self, seq: Sequence):
        self.seq, self.synced = seq, len(seq.tokens)
        seq.owner = self
        self.ask: DraftAsk | None = None
        self.draft: list[int] = []
        self.done = True


class DraftModel:
    """Greedy drafts from a second model for any number of sequences at once (see the module's doc)."""

    def __init__(self, model: Model, n_ctx: int, max_seqs: int, page_size: int, max_batch_tokens: int,
                 n_vocab: int | None = None):
        """n_vocab: the model's vocabulary size; a draft's larger one (by a few tokens) drafts none of the rest."""
        self.model, self.n_ctx = model, n_ctx
        self.n_vocab = min(n_vocab or model.n_vocab, model.n_vocab)
        n_pages = -(-n_ctx * max_seqs // page_size)
        self.pool = PagePool(n_pages, page_size)
        cache = model.new_kv_cache(n_pages + 1, page_size)  # the extra page: the runner's padding
        self.tree = RadixCache(self.pool)
        self.scheduler = Scheduler(self.pool, self.tree, SchedulerConfig(
            max_seqs=max_seqs, max_batch_tokens=max_batch_tokens, max_logit_rows=min(model.max_output_rows, 1024)))
        self.runner = ModelRunner(model, cache, max_batch_tokens, max_seqs, -(-n_ctx // page_size), pad_page=n_pages)
        self._shadows: dict[int, _Shadow] = {}  # by the target sequence's id
        self.steps = 0  # draft steps run (for benchmarks)

    def draft(self, asks: list[DraftAsk]) -> dict[int, list[int]]:
        """Each ask's draft (possibly empty), by the target sequence's id."""
        shadows = [s for s in (self._prepare(a) for a in asks) if s is not None]
        for _ in range(self._max_steps(shadows)):
            if all(s.done for s in shadows) or not self._step():
                break
        for s in shadows:  # a shadow left unfinished (no room in the pool) drafts no more this round
            s.done = True
        return {s.ask.seq.id: s.draft for s in shadows}

    def finished(self, seq: Sequence) -> None:
        """The target's sequence ended: its shadow leaves, what it computed of the target's tokens
        stays in the draft's prefix tree."""
        shadow = self._shadows.pop(seq.id, None)
        if shadow is not None:
            self._sync(shadow, seq.tokens)
            self.scheduler.finish(shadow.seq, "stop")

    def clear(self) -> None:
        self.tree.clear()

    # ---- a round ----
    def _prepare(self, ask: DraftAsk) -> _Shadow | None:
        """The ask's shadow, synced with the target and ready to draft (None: the sequence is
        too long for the draft's context)."""
        tokens = ask.seq.tokens
        n = min(ask.n, self.n_ctx - len(tokens) - 1)
        shadow = self._shadows.get(ask.seq.id)
        if n < 1:
            if shadow is not None:
                self.finished(ask.seq)
            return None
        if shadow is None:
            shadow = self._shadows[ask.seq.id] = _Shadow(Sequence(list(tokens), self.n_ctx - len(tokens)))
            self.scheduler.add(shadow.seq)
        else:
            self._sync(shadow, tokens)
        shadow.ask, shadow.draft, shadow.done = DraftAsk(ask.seq, n, ask.p_min), [], False
        return shadow

    def _sync(self, shadow: _Shadow, tokens: list[int]) -> None:
        """The shadow's tokens := the target's; its KV rolled back to the tokens both agree on."""
        seq = shadow.seq
        common = shadow.synced + common_prefix(seq.tokens[shadow.synced:], tokens[shadow.synced:])
        if seq.n_computed > common:
            seq.n_computed = common
            self.scheduler.drop_unused_pages(seq)
        del seq.tokens[common:]
        seq.tokens.extend(tokens[common:])
        shadow.synced = len(tokens)

    def _max_steps(self, shadows: list[_Shadow]) -> int:
        """Steps a round may take: the catch-up tokens in steps of the batch's size, then one per token."""
        if not shadows:
            return 0
        pending = sum(s.seq.n_pending for s in shadows)
        return -(-pending // self.scheduler.config.max_batch_tokens) + max(s.ask.n for s in shadows) + 1

    def _step(self) -> bool:
        """One draft step of every shadow with something pending; False when none could run."""
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return False
        logits = self.runner.run(plan)
        self.scheduler.complete(plan)
        self.steps += 1
        row = 0
        for chunk in plan.chunks:
            row += len(chunk.logit_rows)
            seq = chunk.seq
            if chunk.logit_rows and seq.n_computed == len(seq.tokens):
                self._take(seq.owner, logits[row - 1])
        return True

    def _take(self, shadow: _Shadow, row: np.ndarray) -> None:
        """The shadow's next draft token from its row: the greedy one, if likely enough."""
        if shadow.done:
            return
        token = int(np.argmax(row[:self.n_vocab]))
        top = float(row[token])
        p = 1.0 / float(np.exp(row.astype(np.float64) - top).sum())
        if not p >= shadow.ask.p_min:  # (NaN logits draft nothing)
            shadow.done = True
            return
        shadow.draft.append(token)
        if len(shadow.draft) >= shadow.ask.n:
            shadow.done = True  # the last draft token is the target's to compute
        else:
            shadow.seq.tokens.append(token)
