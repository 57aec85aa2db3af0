"""Constrained generation on the real models: at temperature 1, every output produced under a
JSON schema's grammar validates against the schema."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from ember.engine import FinishEvent, Request, TokenEvent
from ember.engine.engine import GrammarSpec
from ember.gbnf import schema_to_gbnf
from ember.sampler import SamplingParams

SCHEMAS = Path(__file__).resolve().parent.parent / "bench" / "schemas"
ALL = sorted(p for p in SCHEMAS.glob("*.json") if not p.name.endswith((".examples.json", ".invalid.json")))
QUICK = ALL[::4]  # the default suite samples the corpus; `-m slow` runs all of it


def generate(llm, schema: dict, seeds: list[int], max_tokens: int = 256) -> list[tuple[str, str]]:
    """(text, finish reason) per seed, all submitted at once so the engine batches them."""
    grammar = GrammarSpec(schema_to_gbnf(schema))
    prompt = llm.chat_ids([{"role": "user", "content": "Reply with a JSON value for this schema: "
                            + json.dumps(schema)[:400]}])
    handles = [llm.engine.submit(Request(prompt, max_tokens, SamplingParams(temperature=1.0, seed=s),
                                         grammar=grammar)) for s in seeds]
    out = []
    for h in handles:
        text, reason = "", None
        for ev in h:
            if isinstance(ev, TokenEvent):
                text += ev.text
            elif isinstance(ev, FinishEvent):
                text += ev.text
                reason = ev.reason
                assert ev.error is None, ev.error
        out.append((text, reason))
    return out


def check_outputs(llm, paths: list[Path], seeds: list[int]) -> None:
    finished = total = 0
    for path in paths:
        schema = json.loads(path.read_text())
        for text, reason in generate(llm, schema, seeds):
            total += 1
            if reason == "stop":  # the grammar completed; cut-off outputs are checked as prefixes by the engine
                finished += 1
                jsonschema.validate(json.loads(text), schema)
    assert finished >= total // 2, f"only {finished} of {total} outputs completed"


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_schema_outputs_validate(llm, name):
    check_outputs(llm(name), QUICK, seeds=[1, 2])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_schema_outputs_validate_whole_corpus(llm, name):
    check_outputs(llm(name), ALL, seeds=[1, 2, 3, 4])


def run_tokens(llm, grammar: GrammarSpec, logprobs: int | None) -> list[int]:
    prompt = llm.tokenize("A list of numbers:")
    h = llm.engine.submit(Request(prompt, 12, SamplingParams(temperature=0.0), grammar=grammar, logprobs=logprobs))
    tokens = []
    for ev in h:
        if isinstance(ev, TokenEvent):
            tokens.append(ev.token)
        elif isinstance(ev, FinishEvent):
            assert ev.error is None, ev.error
    return tokens


def test_forced_tokens_are_appended_without_sampling(llm):
    """Where the grammar allows a single token, the engine appends it unsampled and computes the
    stretch in one step; the output is the one token-by-token sampling gives (with logprobs on,
    which turns the shortcut off)."""
    m = llm("smollm2")
    ids = m.tokenize(" one two three", add_special=False)
    grammar = GrammarSpec("root ::= " + " ".join(f"<[{i}]>" for i in ids) + ' [0-9] [0-9] "."')
    before_forced, before_steps = m.engine.metrics.forced_tokens, m.engine.metrics.steps
    fast = run_tokens(m, grammar, logprobs=None)
    forced, steps = m.engine.metrics.forced_tokens - before_forced, m.engine.metrics.steps - before_steps
    slow = run_tokens(m, grammar, logprobs=1)
    assert fast[:len(ids)] == ids and fast == slow
    assert forced == len(ids)  # all but the first (sampled from the prompt's logits), and the final "."
    assert steps <= len(fast) - forced + 1
