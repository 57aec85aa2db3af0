"""llama-server's /infill: code completion between a prefix and a suffix (fill-in-the-middle).

The prompt is laid out in llama-server's repo-level pattern, with the vocabulary's FIM tokens
(tokenizer.ggml.fim_* ids, or the Qwen2.5-Coder / StarCoder / CodeLlama token texts the
tokenizer recognises):

    [FIM_REP]myproject\\n [FIM_SEP]file0\\n text0 ... [FIM_SEP]filename\\n
    [BOS] [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]

The prefix keeps its last 3/4 of a batch of tokens, the suffix its first 1/4 (less the prompt),
the extra files fill what the context has left beyond a batch; the rest is a /completion.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.request import Limits, Prompts
from ..errors import APIError, invalid
from ..fields import Fields, _is_integer
from .request import CompletionRequest, parse_completion

FIM_BATCH = 2048  # llama-server's default batch, which sets the prefix and suffix shares
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"  # between extra files where the vocabulary has no file separator


@dataclass(frozen=True, slots=True)
class InfillRequest:
    completion: CompletionRequest  # its prompt is filled in by infill_ids
    prefix: tuple  # text and token ids
    suffix: tuple
    extra: tuple[tuple[str, str], ...]  # (filename, text) of the other files
    prompt: str


def parse_infill(body: Fields, limits: Limits) -> InfillRequest:
    prefix, suffix = _mixed(body, "input_prefix"), _mixed(body, "input_suffix")
    extra = tuple(_chunk(Fields(c, f"input_extra[{i}]")) for i, c in enumerate(body.list("input_extra", [])))
    prompt = body.str("prompt", "")
    return InfillRequest(parse_completion(body, limits, items=[""]), prefix, suffix, extra, prompt)


def _mixed(body: Fields, key: str) -> tuple:
    value = body.data.get(key)
    if value is None:
        raise invalid(key, f"{key} is required (text, or an array of text and token ids)", "missing_field")
    parts = [value] if isinstance(value, str) else value
    if not isinstance(parts, list) or not all(isinstance(p, str) or _is_integer(p) for p in parts):
        raise invalid(key, f"{key} must be text, or an array of text and token ids", "invalid_type")
    return tuple(p if isinstance(p, str) else int(p) for p in parts)


def _chunk(c: Fields) -> tuple[str, str]:
    text = c.str("text")
    if text is None:
        raise invalid(c.name("text"), f"{c.name('text')} is required (a string)", "missing_field")
    return c.str("filename", "tmp"), text


def fim_tokens(tokenizer) -> dict[str, int]:
    """The FIM roles the vocabulary has; 400 naming the missing ones when it cannot infill."""
    ids = tokenizer.vocab.ids
    missing = [name for role, name in (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle"))
               if role not in ids]
    if missing:
        raise APIError(400, f"this model cannot infill: its vocabulary has no FIM {', '.join(missing)} token "
                            "(tokenizer.ggml.fim_pre/suf/mid_token_id, or <|fim_prefix|>, <fim_prefix>, <PRE> ...)",
                       param="input_prefix", code="fim_not_supported")
    return {r: ids[r] for r in ("fim_pre", "fim_suf", "fim_mid", "fim_rep", "fim_sep") if r in ids}


def infill_ids(tokenizer, req: InfillRequest, n_ctx: int, n_predict: int) -> list[int]:
    """The prompt's ids in llama-server's layout (module doc)."""
    fim = fim_tokens(tokenizer)
    text = lambda s: tokenizer.encode(s, add_special=False, parse_special=False)  # noqa: E731
    mixed = lambda parts: [i for p in parts for i in (text(p) if isinstance(p, str) else [p])]  # noqa: E731
    prompt = tokenizer.encode(req.prompt, add_special=False, parse_special=True)
    batch = min(FIM_BATCH, n_ctx)
    prefix, suffix = mixed(req.prefix), mixed(req.suffix)
    prefix = prefix[len(prefix) - min(len(prefix), 3 * (batch // 4)):]
    suffix = suffix[:max(0, batch // 4 - (2 + len(prompt)))]
    head = [fim["fim_pre"], *prefix, *prompt]
    if tokenizer.add_bos and tokenizer.bos_id is not None:
        head.insert(0, tokenizer.bos_id)
    extra = extra_ids(fim, text, req.extra)
    take = min(max(0, n_ctx - batch - 2 * n_predict), len(extra))
    return extra[len(extra) - take:] + head + [fim["fim_suf"], *suffix, fim["fim_mid"]]


def extra_ids(fim: dict, text, chunks) -> list[int]:
    """The other files, repo-level: [FIM_REP]myproject, then [FIM_SEP]name and text for each."""
    out = [fim["fim_rep"], *text("myproject\n")] if "fim_rep" in fim else []
    for name, body in chunks:
        out += [fim["fim_sep"], *text(name + "\n")] if "fim_sep" in fim else text(CHUNK_SEPARATOR)
        out += text(body)
    if "fim_sep" in fim:
        out += [fim["fim_sep"], *text("filename\n")]
    return out


def with_prompt(req: InfillRequest, ids: list[int]) -> CompletionRequest:
    gen = req.completion.gen
    return replace(req.completion, gen=replace(gen, prompt=Prompts((tuple(ids),), ("input_prefix",))))
