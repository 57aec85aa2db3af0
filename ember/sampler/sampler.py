"""One sequence's sampler: the chain its SamplingParams describe, plus the state that lives
across steps (penalty and DRY windows, mirostat's mu, the seeded random streams).

    sampler = Sampler(params, vocab)          # vocab: SamplerVocab or a Tokenizer
    sampler.accept_many(prompt_ids)           # penalties see the prompt, as in llama-server
    token = sampler.sample(logits, allowed)   # allowed: grammar mask or None
    sampler.accept(token)
    lp = sampler.logprobs()                   # chosen token's logprob + top n_probs

Order of one step, as llama.cpp: the grammar mask, logit bias (with ignore_eos's bans), then
either the configured chain and a draw from what is left, or temperature and mirostat.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from . import filters
from .candidates import NEG_INF, Candidates, logsumexp, mask_logits, top_positions
from .history import TokenWindow, dry_penalties
from .mirostat import mirostat_v1, mirostat_v2
from .params import SamplingParams
from .rng import Mt19937, resolve_seed
from .vocab import SamplerVocab

SUBSET_FRACTION = 8  # a mask allowing at most 1/8 of the vocabulary becomes an explicit subset


class SamplingError(ValueError):
    """No token can be chosen for this sequence at this step; `code` says why."""

    code = "sampling_error"


class NoTokenAllowed(SamplingError):
    """The grammar, logit_bias and ignore_eos together leave no token (the request's doing)."""

    code = "no_token_allowed"


class NonFiniteLogits(SamplingError):
    """The model's logits hold NaN or +inf, or nothing but -inf (the model's doing)."""

    code = "non_finite_logits"


@dataclass(slots=True)
class TokenLogprobs:
    token: int
    logprob: float
    top_ids: np.ndarray  # (n,) int64, most likely first
    top_logprobs: np.ndarray  # (n,) float64


@dataclass(slots=True)
class _LastDraw:
    token: int
    raw: np.ndarray  # (n_vocab,) the logits sample() was given
    ids: np.ndarray  # (m,) the candidates the token was drawn from
    probs: np.ndarray  # (m,) their probabilities


class Sampler:
    def __init__(self, params: SamplingParams | None = None, vocab=None, n_ctx: int | None = None):
        """`vocab` (SamplerVocab or a tokenizer) is needed for DRY, ignore_eos and text logit
        biases; `n_ctx` is what -1 means for repeat_last_n and dry_penalty_last_n (None: all)."""
        self.params = p = params or SamplingParams()
        self.vocab = SamplerVocab.of(vocab) if vocab is not None else None
        self.seed = resolve_seed(p.seed)
        self._rng = Mt19937(self.seed)  # the final draw and mirostat
        self._xtc_rng = Mt19937(self.seed)  # llama.cpp gives XTC its own stream from the same seed
        self.mu = 2.0 * p.mirostat_tau
        self._penalties = _penalty_window(p, n_ctx)
        self._dry = _dry_window(p, n_ctx)
        self._breakers = self._need_vocab("DRY").dry_breakers(p.dry_sequence_breakers) if self._dry is not None else None
        self._bias_tokens, self._bias = self._resolve_bias()
        self._greedy_steps = _greedy_steps(p)
        self._n_vocab: int | None = None
        self._last: _LastDraw | None = None
        # fixed for the sampler's life, and asked for every sequence at every step: computed once
        self.best_needed = self._count_best_needed()
        self._banned = frozenset(int(t) for t in self._bias_tokens)
        self.n_banned = int(np.count_nonzero(np.isneginf(self._bias)))  # tokens never chosen (-inf bias)

    def _count_best_needed(self) -> int:
        """How many of a row's best tokens suffice to make the choice (then a backend may reduce rows
        to those on the device), or 0 when it needs the whole row. Greedy with nothing that changes
        logits before the argmax but bans (-inf biases, ignore_eos): one more than the bans."""
        if self._greedy_steps is None or self._penalties is not None or self._dry is not None:
            return 0
        if self._bias_tokens.size and not np.all(np.isneginf(self._bias)):
            return 0
        return 1 + int(self._bias_tokens.size)

    @property
    def banned(self) -> frozenset:
        """The ids choose_from_best passes over."""
        return self._banned

    def choose_from_best(self, ids) -> int:
        """The greedy choice from a row's best ids (best first, at least best_needed of them):
        the first that is not banned. Accept it as usual."""
        return first_not_banned(ids, self._banned)

    # ---- per-step API ----
    def sample(self, logits: np.ndarray, allowed_mask: np.ndarray | None = None) -> int:
        """Choose the next token (without accepting it). `logits`: (n_vocab,) float. `allowed_mask`:
        tokens the grammar allows, a bool array (n_vocab,) or packed bits, uint32 (ceil(n_vocab/32),),
        bit j of word i = token 32 i + j. It applies before logit bias and the chain."""
        raw = self._check_logits(logits)
        c = Candidates(_vocab_ids(raw.size), raw, full=True, owned=False)
        if allowed_mask is not None:
            c = _apply_mask(c, allowed_mask)
        if self._bias_tokens.size:
            c = filters.shift(c, self._bias_tokens, self._bias)
        if self.params.mirostat:
            c, probs, index = self._mirostat(c)
        elif self._greedy_steps is not None:
            c, probs, index = self._greedy(c)
        else:
            for name in self.params.samplers:
                c = STEPS[name](self, c)
            c, probs, index = self._draw(c)
        token = int(c.ids[index])
        self._last = _LastDraw(token, raw, c.ids, probs)
        return token

    def accept(self, token: int) -> None:
        """Record a token of the sequence (a sampled one, or one of the prompt)."""
        token = self._check_token(token)
        if self._penalties is not None:
            self._penalties.push(token)
        if self._dry is not None:
            self._dry.push(token)

    def accept_many(self, tokens: Iterable[int]) -> None:
        """accept() each token in order; a window only ever sees its last `size` of them."""
        tokens = [self._check_token(t) for t in tokens]
        for window in (self._penalties, self._dry):
            if window is not None:
                size = window.tokens.maxlen
                for t in tokens if size is None else tokens[-size:]:
                    window.push(t)

    def __call__(self, logits: np.ndarray, allowed_mask: np.ndarray | None = None) -> int:
        """sample() and accept() in one."""
        token = self.sample(logits, allowed_mask)
        self.accept(token)
        return token

    def logprobs(self, token: int | None = None, n: int | None = None) -> TokenLogprobs:
        """Log-probability of `token` (default: the last sampled one) and the n (default: n_probs)
        most likely tokens, for the last sample() call; call it before the logits buffer is reused.
        By default from the model's logits (before grammar mask, bias and chain, as llama-server
        reports them); with post_sampling_probs from the candidates the token was drawn from."""
        if self._last is None:
            raise RuntimeError("logprobs() reports on the last sample(); nothing was sampled yet")
        last = self._last
        token = last.token if token is None else int(token)
        n = self.params.n_probs if n is None else n
        if self.params.post_sampling_probs:
            return _drawn_logprobs(last, token, n)
        return _model_logprobs(last.raw, token, n)

    # ---- lifecycle ----
    def fork(self) -> Sampler:
        """An independent copy with the same state, for n > 1 and speculation."""
        twin = Sampler.__new__(Sampler)
        twin.__dict__.update(self.__dict__)
        twin._rng, twin._xtc_rng = self._rng.copy(), self._xtc_rng.copy()
        twin._penalties = self._penalties.copy() if self._penalties is not None else None
        twin._dry = self._dry.copy() if self._dry is not None else None
        return twin

    __copy__ = fork

    def __deepcopy__(self, memo) -> Sampler:
        return self.fork()  # the vocabulary and params are shared, never copied

    def reset(self) -> None:
        """Back to the state right after construction (same seed)."""
        self._rng, self._xtc_rng = Mt19937(self.seed), Mt19937(self.seed)
        self.mu = 2.0 * self.params.mirostat_tau
        for window in (self._penalties, self._dry):
            if window is not None:
                window.clear()
        self._last = None

    # ---- the chain's steps (STEPS maps the names of `samplers` to these) ----
    def _step_penalties(self, c: Candidates) -> Candidates:
        if self._penalties is None:
            return c
        p = self.params
        tokens, counts = self._penalties.counted()
        return filters.penalize(c, tokens, counts, p.repeat_penalty, p.frequency_penalty, p.presence_penalty)

    def _step_dry(self, c: Candidates) -> Candidates:
        if self._dry is None:
            return c
        p = self.params
        tokens, amounts = dry_penalties(self._dry.tokens, self._breakers, p.dry_multiplier, p.dry_base,
                                        p.dry_allowed_length)
        return filters.shift(c, tokens, -amounts) if tokens.size else c

    def _step_xtc(self, c: Candidates) -> Candidates:
        p = self.params
        if p.xtc_probability <= 0 or p.xtc_threshold > 0.5 or c.size < 2:
            return c  # llama.cpp draws nothing in these cases
        if self._xtc_rng.uniform_f32() > p.xtc_probability:
            return c
        return filters.xtc(c, p.xtc_threshold, p.min_keep)

    # ---- ends of the chain ----
    def _draw(self, c: Candidates) -> tuple[Candidates, np.ndarray, int]:
        """llama.cpp's dist: walk the candidates in order until the running sum of exp(logit - max)
        reaches u times the total."""
        top = _check_left(c)
        u = self._rng.uniform()  # drawn even for one candidate, as llama.cpp does (keeps streams aligned)
        if c.size == 1:
            return c, np.ones(1), 0
        weights = np.exp(c.logits - top)
        running = np.cumsum(weights, dtype=np.float64)
        target = max(running[-1] * u, np.finfo(np.float64).tiny)
        index = min(int(np.searchsorted(running, target, side="left")), c.size - 1)
        return c, weights / running[-1], index

    def _greedy(self, c: Candidates) -> tuple[Candidates, np.ndarray, int]:
        """temperature <= 0 with nothing before it that could drop the top token: the answer is
        the argmax after the steps that change logits, so the filters need not run."""
        for name in self._greedy_steps:
            c = STEPS[name](self, c)
        best = int(np.argmax(c.logits))
        c = c.select(np.array([best]), True)
        _check_left(c)
        return c, np.ones(1), 0

    def _mirostat(self, c: Candidates) -> tuple[Candidates, np.ndarray, int]:
        p = self.params
        c = filters.temperature(c, p.temperature)
        _check_left(c)
        if p.mirostat == 1:
            c, probs, index, self.mu = mirostat_v1(c, p.mirostat_tau, p.mirostat_eta, self.mu,
                                                   self._n_vocab, self._rng.uniform)
        else:
            c, probs, index, self.mu = mirostat_v2(c, p.mirostat_tau, p.mirostat_eta, self.mu, self._rng.uniform)
        return c, probs, index

    # ---- setup and checks ----
    def _need_vocab(self, what: str) -> SamplerVocab:
        if self.vocab is None:
            raise ValueError(f"{what} needs the vocabulary: pass vocab= (a SamplerVocab or the tokenizer)")
        return self.vocab

    def _resolve_bias(self) -> tuple[np.ndarray, np.ndarray]:
        """Logit bias entries (text ones tokenized) plus ignore_eos's bans, summed per token."""
        tokens, values = [], []
        for token, bias in self.params.logit_bias:
            ids = self._need_vocab("a text logit_bias").encode(token) if isinstance(token, str) else [token]
            tokens += ids
            values += [bias] * len(ids)
        if self.params.ignore_eos:
            eog = self._need_vocab("ignore_eos").eog_ids.tolist()
            tokens += eog
            values += [-np.inf] * len(eog)
        unique, where = np.unique(np.array(tokens, np.int64), return_inverse=True)
        summed = np.zeros(unique.size)
        np.add.at(summed, where, np.array(values, np.float64))
        if self.vocab is not None:
            _check_tokens(unique, self.vocab.n_vocab)
        return unique, summed

    def _check_token(self, token: int) -> int:
        token = int(token)
        if token < 0 or (self._n_vocab is not None and token >= self._n_vocab):
            raise ValueError(f"token {token} is outside the vocabulary")
        return token

    def _check_logits(self, logits: np.ndarray) -> np.ndarray:
        x = np.asarray(logits)
        if x.ndim != 1 or x.size == 0:
            raise ValueError(f"logits must be a non-empty 1-D array, got shape {x.shape}")
        if x.dtype != np.float32:
            x = x.astype(np.float32)
        if self._n_vocab is None:
            _check_tokens(self._bias_tokens, x.size)
            self._n_vocab = x.size
        elif x.size != self._n_vocab:
            raise ValueError(f"logits have {x.size} entries; this sampler's vocabulary has {self._n_vocab}")
        top = x.max()
        if not -np.inf < top < np.inf:
            raise NonFiniteLogits(f"the model produced non-finite logits "
                                  f"({'NaN' if np.isnan(top) else 'inf' if top > 0 else 'all -inf'})")
        return x


STEPS: dict[str, Callable[[Sampler, Candidates], Candidates]] = {
    "penalties": Sampler._step_penalties,
    "dry": Sampler._step_dry,
    "top_n_sigma": lambda s, c: filters.top_n_sigma(c, s.params.top_n_sigma),
    "top_k": lambda s, c: filters.top_k(c, s.params.top_k),
    "typ_p": lambda s, c: filters.typical(c, s.params.typical_p, s.params.min_keep),
    "top_p": lambda s, c: filters.top_p(c, s.params.top_p, s.params.min_keep),
    "min_p": lambda s, c: filters.min_p(c, s.params.min_p, s.params.min_keep),
    "xtc": Sampler._step_xtc,
    "temperature": lambda s, c: filters.dynamic_temperature(c, s.params.temperature, s.params.dynatemp_range,
                                                            s.params.dynatemp_exponent),
}


def first_not_banned(ids, banned) -> int:
    """The first of ids (best first) not in banned: a greedy choice from a row's best ids (-1, where
    a row has fewer comparable logits than ids, is returned as it is)."""
    for token in ids.tolist() if hasattr(ids, "tolist") else ids:
        if token not in banned:
            return int(token)
    raise NoTokenAllowed("no token is allowed: every candidate token is banned")


def _penalty_window(p: SamplingParams, n_ctx: int | None) -> TokenWindow | None:
    neutral = p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
    if p.repeat_last_n == 0 or neutral:
        return None
    return TokenWindow(n_ctx if p.repeat_last_n == -1 else p.repeat_last_n)


def _dry_window(p: SamplingParams, n_ctx: int | None) -> TokenWindow | None:
    if p.dry_multiplier == 0.0 or p.dry_penalty_last_n == 0:
        return None
    return TokenWindow(n_ctx if p.dry_penalty_last_n == -1 else p.dry_penalty_last_n)


def _greedy_steps(p: SamplingParams) -> list[str] | None:
    """For greedy params, the logit-changing steps that run before the argmax; None when the
    chain must run in full (mirostat, sampling, or a step before temperature that can drop the
    top token: typical-p, XTC)."""
    if p.mirostat or not p.greedy:
        return None
    before = p.samplers[:p.samplers.index("temperature")]
    if "typ_p" in before and p.typical_p < 1.0:
        return None
    if "xtc" in before and p.xtc_probability > 0 and p.xtc_threshold <= 0.5:
        return None
    return [name for name in before if name in ("penalties", "dry")]


@functools.lru_cache(maxsize=8)
def _vocab_ids(n: int) -> np.ndarray:
    """0..n-1, shared read-only by every sampler of that vocabulary size."""
    ids = np.arange(n, dtype=np.int64)
    ids.flags.writeable = False
    return ids


def _apply_mask(c: Candidates, mask: np.ndarray) -> Candidates:
    allowed = _bool_mask(mask, c.size)
    n_allowed = int(np.count_nonzero(allowed))
    if n_allowed == 0:
        raise NoTokenAllowed("no token is allowed: the grammar allows none")
    if n_allowed * SUBSET_FRACTION <= c.size:
        ids = np.flatnonzero(allowed)
        return Candidates(ids, c.logits[ids])
    return Candidates(c.ids, mask_logits(c.logits, allowed), full=True)


def _bool_mask(mask: np.ndarray, n_vocab: int) -> np.ndarray:
    mask = np.asarray(mask)
    if mask.dtype == np.bool_ and mask.shape == (n_vocab,):
        return mask
    words = (n_vocab + 31) // 32
    if mask.dtype == np.uint32 and mask.shape == (words,):
        bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), count=n_vocab, bitorder="little")
        return bits.view(np.bool_)
    raise ValueError(f"allowed_mask must be bool ({n_vocab},) or packed uint32 ({words},), "
                     f"got {mask.dtype} {mask.shape}")


def _check_tokens(tokens: np.ndarray, n_vocab: int) -> None:
    if tokens.size and tokens[-1] >= n_vocab:
        raise ValueError(f"logit_bias token {int(tokens[-1])} is outside the vocabulary (0..{n_vocab - 1})")


def _check_left(c: Candidates) -> np.float32:
    """The top logit; an error when nothing can be drawn."""
    top = c.logits.max() if c.size else NEG_INF
    if top == NEG_INF:
        raise NoTokenAllowed("no token is allowed: logit_bias, ignore_eos and the grammar together ban every token")
    return top


def _model_logprobs(raw: np.ndarray, token: int, n: int) -> TokenLogprobs:
    if not 0 <= token < raw.size:
        raise ValueError(f"token {token} is outside the vocabulary (0..{raw.size - 1})")
    lse = logsumexp(raw)
    top = top_positions(raw, n) if n > 0 else np.zeros(0, np.int64)
    return TokenLogprobs(token, float(raw[token]) - lse, top, raw[top].astype(np.float64) - lse)


def _drawn_logprobs(last: _LastDraw, token: int, n: int) -> TokenLogprobs:
    with np.errstate(divide="ignore"):
        logp = np.log(last.probs)
    at = np.flatnonzero(last.ids == token)
    order = np.argsort(-last.probs, kind="stable")[:n]
    order = order[last.probs[order] > 0]
    return TokenLogprobs(token, float(logp[at[0]]) if at.size else -np.inf, last.ids[order], logp[order])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities along the last axis, computed in float64."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
