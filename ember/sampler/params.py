"""Per-request sampling parameters: llama.cpp's names, defaults and sampler order.

Defaults follow llama.cpp's `common_params_sampling`; request field names follow
llama-server's JSON (`temperature`, `typical_p`, `repeat_last_n`, ...). Every field is
checked when the dataclass is built, so a bad request fails with a message naming the field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

# llama.cpp's default chain, in order (names as llama-server reports them)
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
SAMPLER_NAMES = frozenset(DEFAULT_SAMPLERS)
# llama.cpp's other spellings, and the one-letter codes of --sampling-seq / a "samplers" string
SAMPLER_ALIASES = {"top-k": "top_k", "top-p": "top_p", "nucleus": "top_p", "top-n-sigma": "top_n_sigma",
                   "typical-p": "typ_p", "typical": "typ_p", "typ-p": "typ_p", "typ": "typ_p",
                   "min-p": "min_p", "temp": "temperature"}
SAMPLER_LETTERS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p",
                   "p": "top_p", "m": "min_p", "x": "xtc", "t": "temperature"}
UNSUPPORTED_SAMPLERS = {"infill", "adaptive_p", "adaptive-p", "i", "a"}

DEFAULT_DRY_BREAKERS = ("\n", ":", "\"", "*")
RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: draw a seed from the system
MAX_SEED = 0xFFFFFFFF


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.8  # <= 0: keep only the most likely token
    dynatemp_range: float = 0.0  # > 0: temperature moves within temperature +- range with the entropy
    dynatemp_exponent: float = 1.0
    top_k: int = 40  # <= 0 disables
    top_p: float = 0.95  # 1 disables
    min_p: float = 0.05  # 0 disables
    typical_p: float = 1.0  # 1 disables
    top_n_sigma: float = -1.0  # <= 0 disables
    xtc_probability: float = 0.0  # 0 disables
    xtc_threshold: float = 0.1  # > 0.5 disables
    repeat_last_n: int = 64  # 0 disables the penalties, -1 = the whole context
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0  # 0 disables DRY
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64  # 0 disables DRY, -1 = the whole context
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_DRY_BREAKERS
    mirostat: int = 0  # 1 or 2 replaces the chain (after logit bias and temperature)
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    logit_bias: tuple[tuple[int | str, float], ...] = ()  # (token id or text, bias); -inf bans
    ignore_eos: bool = False  # ban end-of-generation tokens
    min_keep: int = 0  # filters keep at least this many tokens (0: at least one)
    seed: int | None = None  # None or -1: a random seed
    n_probs: int = 0  # how many alternatives logprobs() reports
    post_sampling_probs: bool = False  # report probabilities after the chain instead of the model's
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS

    def __post_init__(self):
        for f in fields(self):
            check = _CHECKS.get(f.name)
            if check is not None:
                setattr(self, f.name, check(f.name, getattr(self, f.name)))

    @property
    def greedy(self) -> bool:
        """True when the temperature step leaves only the most likely remaining token."""
        if self.mirostat:
            return self.temperature <= 0
        return "temperature" in self.samplers and self.temperature + max(self.dynatemp_range, 0.0) <= 0

    @property
    def random_seed(self) -> bool:
        return self.seed is None or self.seed in (-1, RANDOM_SEED)

    @classmethod
    def greedy_params(cls) -> SamplingParams:
        return cls(temperature=0.0)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from request JSON with llama-server's field names; null means "default".
        Unknown keys are an error: filter the request to sampling fields first."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling parameters must be an object, got {type(d).__name__}")
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            name = _JSON_NAMES.get(key)
            if name is None:
                raise ValueError(f"unknown sampling field {key!r}")
            if value is None:
                continue
            if name in kwargs and kwargs[name] != value:
                raise ValueError(f"{key!r} conflicts with another spelling of the same field")
            kwargs[name] = value
        return cls(**kwargs)


# ---- field checks: each takes (name, value) and returns the normalized value or raises ----

def _number(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {v!r}")
    v = float(v)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def _integer(name: str, v: Any) -> int:
    if isinstance(v, float) and v.is_integer():
        v = int(v)  # JSON clients sometimes send 40.0
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    return v


def _flag(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be true or false, got {v!r}")
    return v


def _number_in(lo: float, hi: float = math.inf):
    def check(name: str, v: Any) -> float:
        v = _number(name, v)
        if not lo <= v <= hi:
            raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {v:g}")
        return v
    return check


def _integer_from(lo: int):
    def check(name: str, v: Any) -> int:
        v = _integer(name, v)
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
        return v
    return check


def _positive(name: str, v: Any) -> float:
    v = _number(name, v)
    if v <= 0:
        raise ValueError(f"{name} must be > 0, got {v:g}")
    return v


def _mirostat(name: str, v: Any) -> int:
    v = _integer(name, v)
    if v not in (0, 1, 2):
        raise ValueError(f"{name} must be 0 (off), 1 or 2, got {v}")
    return v


def _seed(name: str, v: Any) -> int | None:
    if v is None:
        return None
    v = _integer(name, v)
    if not -1 <= v <= MAX_SEED:
        raise ValueError(f"{name} must be -1 (random) or in [0, {MAX_SEED}], got {v}")
    return v


def _breakers(name: str, v: Any) -> tuple[str, ...]:
    if isinstance(v, str) or not isinstance(v, (list, tuple)) or not v:
        raise ValueError(f"{name} must be a non-empty list of strings, got {v!r}")
    for s in v:
        if not isinstance(s, str) or not s:
            raise ValueError(f"{name} entries must be non-empty strings, got {s!r}")
    return tuple(v)


def _samplers(name: str, v: Any) -> tuple[str, ...]:
    """A list of names, a ';'-separated string of names, or a string of one-letter codes."""
    if isinstance(v, str):
        if ";" in v or _canonical(v) is not None or v in UNSUPPORTED_SAMPLERS:
            return tuple(_sampler_name(name, s) for s in v.split(";") if s)
        return tuple(_sampler_letter(name, c) for c in v)
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"{name} must be a list of sampler names or a string, got {v!r}")
    return tuple(_sampler_name(name, s) for s in v)


def _canonical(s: str) -> str | None:
    return s if s in SAMPLER_NAMES else SAMPLER_ALIASES.get(s)


def _sampler_name(field_name: str, s: Any) -> str:
    if not isinstance(s, str):
        raise ValueError(f"{field_name} entries must be strings, got {s!r}")
    canonical = _canonical(s.strip())
    if canonical is None:
        why = "is not supported by ember" if s in UNSUPPORTED_SAMPLERS else "is not a known sampler"
        raise ValueError(f"{field_name}: {s!r} {why} (known: {', '.join(DEFAULT_SAMPLERS)})")
    return canonical


def _sampler_letter(field_name: str, c: str) -> str:
    if c not in SAMPLER_LETTERS:
        raise ValueError(f"{field_name}: letter {c!r} is not a sampler code (known: {''.join(SAMPLER_LETTERS)})")
    return SAMPLER_LETTERS[c]


def _logit_bias(name: str, v: Any) -> tuple[tuple[int | str, float], ...]:
    """{token: bias}, [[token, bias], ...] or already-normalized pairs. A token is an id, a
    string of digits (an id, as OpenAI sends them) or text to tokenize; bias false bans."""
    if isinstance(v, dict):
        pairs = list(v.items())
    elif isinstance(v, (list, tuple)):
        pairs = list(v)
    else:
        raise ValueError(f"{name} must be an object or a list of [token, bias] pairs, got {v!r}")
    out = []
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"{name} entries must be [token, bias] pairs, got {pair!r}")
        out.append((_bias_token(name, pair[0]), _bias_value(name, pair[0], pair[1])))
    return tuple(out)


def _bias_token(name: str, t: Any) -> int | str:
    if isinstance(t, str):
        if t.strip().isdigit():
            return int(t)
        if not t:
            raise ValueError(f"{name}: a token text must not be empty")
        return t
    if isinstance(t, bool) or not isinstance(t, int):
        raise ValueError(f"{name}: token must be an id or a string, got {t!r}")
    if t < 0:
        raise ValueError(f"{name}: token id must be >= 0, got {t}")
    return t


def _bias_value(name: str, token: Any, b: Any) -> float:
    if b is False:
        return -math.inf
    if isinstance(b, bool) or not isinstance(b, (int, float)) or math.isnan(b) or b == math.inf:
        raise ValueError(f"{name}[{token!r}] must be a number or false (ban), got {b!r}")
    return float(b)


_CHECKS = {
    "temperature": _number, "dynatemp_range": _number_in(0.0), "dynatemp_exponent": _number_in(0.0),
    "top_k": _integer, "top_p": _number_in(0.0, 1.0), "min_p": _number_in(0.0, 1.0),
    "typical_p": _number_in(0.0, 1.0), "top_n_sigma": _number,
    "xtc_probability": _number_in(0.0, 1.0), "xtc_threshold": _number_in(0.0, 1.0),
    "repeat_last_n": _integer_from(-1), "repeat_penalty": _positive,
    "presence_penalty": _number, "frequency_penalty": _number,
    "dry_multiplier": _number_in(0.0), "dry_base": _number_in(1.0), "dry_allowed_length": _integer_from(0),
    "dry_penalty_last_n": _integer_from(-1), "dry_sequence_breakers": _breakers,
    "mirostat": _mirostat, "mirostat_tau": _number_in(0.0), "mirostat_eta": _number_in(0.0),
    "logit_bias": _logit_bias, "ignore_eos": _flag, "min_keep": _integer_from(0), "seed": _seed,
    "n_probs": _integer_from(0), "post_sampling_probs": _flag, "samplers": _samplers,
}
# request JSON key -> field (llama-server's names; "temp" and "typ_p" as its CLI spells them)
_JSON_NAMES = {f: f for f in _CHECKS} | {"temp": "temperature", "typ_p": "typical_p"}
