"""Runs written back in llama-server's shapes: /completion's result (whole, or one event per
token and the result last), its generation settings, probabilities and prompt progress, and the
replies of /tokenize, /detokenize and /apply-template."""
from __future__ import annotations

import math
import time
from dataclasses import asdict

from ...engine import TokenEvent
from ...sampler import SamplingParams
from ...sampler.params import RANDOM_SEED
from ..core.prompts import render_chat, token_piece
from ..core.request import Chat, Constraint
from ..core.run import Run, Sample, Step
from ..exchange import Format
from ..sse import event
from ..state import ServerModel
from .request import CompletionRequest, TokenizeRequest

_MISSING = object()


class CompletionReply(Format):
    """One result per prompt (a list for several); streamed, one event per token (with its id),
    with return_progress a prompt-progress event when the prompt starts and after each step computing
    part of it, and the result last."""

    def __init__(self, req: CompletionRequest, model: ServerModel):
        self.req, self.model, self.stream = req, model, req.stream

    def whole(self, run: Run, samples: list[Sample]):
        results = [picked(self._result(run, s), self.req.fields) for s in samples]
        return results[0] if len(results) == 1 else results

    def _result(self, run: Run, s: Sample) -> dict:
        gen, model = self.req.gen, self.model
        stop_type, word = _stop_type(s, gen.stop, model)
        prompt = run.prompts[s.index]
        out = {"index": s.index, "content": s.text, "tokens": s.tokens if self.req.return_tokens else [],
               "id_slot": -1, "stop": True, "model": model.id, "tokens_predicted": len(s.tokens),
               "tokens_evaluated": len(prompt), "generation_settings": self.settings(),
               "prompt": model.tokenizer.decode(prompt, special=True), "has_new_line": "\n" in s.text,
               "truncated": False, "stop_type": stop_type, "stopping_word": word, "tokens_cached": s.cached_tokens,
               "timings": timings(s, run.submitted)}
        if gen.logprobs is not None:
            out["completion_probabilities"] = [_probs(model, ev, gen.sampling) for ev in s.logprobs]
        return out

    def settings(self) -> dict:
        gen = self.req.gen
        return generation_settings(gen.sampling, gen.max_tokens, gen.stop, self.req.stream, gen.logprobs or 0,
                                   gen.constraint, self.req.per_token_timings)

    def token(self, run: Run, step: Step):
        index, sample, ev = step.index, step.sample, step.event
        chunk = {"index": index, "content": ev.text, "tokens": [ev.token], "stop": False, "id_slot": -1,
                 "tokens_predicted": len(sample.tokens), "tokens_evaluated": len(run.prompts[index])}
        if self.req.gen.logprobs is not None:
            chunk["completion_probabilities"] = [_probs(self.model, ev, self.req.gen.sampling)]
        if self.req.per_token_timings:
            chunk["timings"] = timings(sample, run.submitted)
        yield event(chunk)

    def finish(self, run: Run, step: Step):
        final = self._result(run, step.sample)
        yield event(picked({**final, "content": step.event.text, "tokens": []}, self.req.fields))

    def progress(self, run: Run, step: Step):
        """llama-server's prompt_progress: prompt tokens in all, served by the cache, in the cache
        now (the cached ones included), and milliseconds since the prompt's processing began."""
        ev = step.event
        out = {"index": step.index, "content": "", "tokens": [], "stop": False, "id_slot": -1, "tokens_predicted": 0,
               "tokens_evaluated": ev.total, "prompt_progress": {"total": ev.total, "cache": ev.cached,
                                                                 "processed": ev.processed,
                                                                 "time_ms": int(ev.seconds * 1000)}}
        if self.req.per_token_timings:  # the prompt so far
            now = time.perf_counter()
            so_far = Sample(step.index, prompt_tokens=ev.processed, cached_tokens=ev.cached, first_at=now, last_at=now)
            out["timings"] = timings(so_far, run.submitted)
        yield event(out)


def picked(result: dict, fields: tuple[str, ...]) -> dict:
    """response_fields: only these fields, each path ("timings/prompt_n") a key of its own."""
    if not fields:
        return result
    out = {}
    for path in fields:
        value = result
        for key in path.split("/"):
            value = value.get(key, _MISSING) if isinstance(value, dict) else _MISSING
        if value is not _MISSING:
            out[path] = value
    return out


def generation_settings(sampling: SamplingParams, n_predict: int, stop: tuple[str, ...] = (), stream: bool = False,
                        n_probs: int = 0, constraint: Constraint | None = None,
                        per_token_timings: bool = False) -> dict:
    """The settings a request runs with, in llama-server's shape."""
    grammar = constraint.grammar if constraint else None
    return {**sampling_settings(sampling), "n_predict": n_predict, "max_tokens": n_predict, "stop": list(stop),
            "stream": stream, "n_probs": n_probs, "grammar": grammar.gbnf if grammar else "",
            "grammar_lazy": bool(grammar and grammar.lazy_triggers), "timings_per_token": per_token_timings}


def sampling_settings(params: SamplingParams) -> dict:
    out = asdict(params)
    out["seed"] = RANDOM_SEED if params.random_seed else params.seed
    out["logit_bias"] = [[t, b if math.isfinite(b) else False] for t, b in params.logit_bias]  # False: banned
    return out


def _stop_type(s: Sample, stop: tuple[str, ...], model: ServerModel) -> tuple[str, str]:
    """Why it stopped, as llama-server says it: "eos", "word" (and which) or "limit"."""
    if s.finish_reason == "length":
        return "limit", ""
    raw = model.tokenizer.decode(s.tokens)
    hits = [(raw.find(w), w) for w in stop if w in raw]
    return ("word", min(hits)[1]) if hits else ("eos", "")


def _probs(model: ServerModel, ev: TokenEvent, sampling: SamplingParams) -> dict:
    """One completion_probabilities entry (probabilities instead of logprobs when
    post_sampling_probs is set, as llama-server does)."""
    post = sampling.post_sampling_probs

    def entry(token: int, logprob: float) -> dict:
        piece = token_piece(model, token)
        value = {"prob": math.exp(logprob)} if post else {"logprob": float(logprob)}
        return {"id": int(token), "token": piece.decode("utf-8", "replace"), "bytes": list(piece), **value}

    top = [entry(t, lp) for t, lp in ev.top_logprobs or ()]
    return {**entry(ev.token, ev.logprob), ("top_probs" if post else "top_logprobs"): top}


def timings(sample: Sample, submitted: float) -> dict:
    """llama-server's `timings` block for one sample (OpenAI's replies carry it too, as llama-server's do)."""
    prompt_ms = max(sample.first_at - submitted, 0.0) * 1000 if sample.first_at else 0.0
    predicted_ms = (sample.last_at - sample.first_at) * 1000 if sample.first_at else 0.0
    prompt_n = sample.prompt_tokens - sample.cached_tokens
    predicted_n = len(sample.tokens)
    drafts = {"draft_n": sample.draft_n, "draft_n_accepted": sample.draft_n_accepted} if sample.draft_n else {}
    return {"cache_n": sample.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n / prompt_ms * 1000 if prompt_ms else 0.0,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / (predicted_n - 1) if predicted_n > 1 else 0.0,
            "predicted_per_second": (predicted_n - 1) / predicted_ms * 1000 if predicted_ms else 0.0, **drafts}


# ---- tokens and templates ----

def tokenized(req: TokenizeRequest, model: ServerModel) -> dict:
    ids = model.tokenizer.encode(req.content, add_special=req.add_special, parse_special=req.parse_special)
    if not req.with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": t, "piece": _piece(model, t)} for t in ids]}


def _piece(model: ServerModel, token: int):
    """A token's text, or its bytes when they are not valid UTF-8 on their own."""
    raw = token_piece(model, token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def detokenized(ids: tuple[int, ...], model: ServerModel) -> dict:
    return {"content": model.tokenizer.decode(list(ids))}


def templated(chat: Chat, model: ServerModel) -> dict:
    return {"prompt": render_chat(model, chat).text}
