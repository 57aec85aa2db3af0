"""GrammarError (with line and column) and GrammarLimits (what a grammar may cost)."""
from __future__ import annotations

from dataclasses import dataclass


class GrammarError(ValueError):
    """A grammar that cannot be used; `line` and `column` (1-based) point at the cause when known."""

    def __init__(self, message: str, line: int | None = None, column: int | None = None):
        self.message, self.line, self.column = message, line, column
        where = f"line {line}, column {column}: " if line is not None else ""
        super().__init__(where + message)


def position(text: str, offset: int) -> tuple[int, int]:
    """1-based (line, column) of a character offset; column counts characters."""
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1


def error_at(text: str, offset: int, message: str) -> GrammarError:
    return GrammarError(message, *position(text, offset))


@dataclass(slots=True, frozen=True)
class GrammarLimits:
    """Bounds that keep a hostile grammar (or a hostile model output) cheap to reject.

    Parse-time limits make `Grammar.parse` fail with a GrammarError. At run time a token that
    would nest calls deeper than max_stack_depth is invalid; parses beyond max_stacks are dropped
    (Matcher.saturated); an automaton beyond max_dfa_states is a GrammarError.
    """
    max_text_bytes: int = 4 << 20        # grammar source size
    max_rules: int = 20_000
    max_alternatives: int = 20_000       # alternatives of one rule or group
    max_nesting_depth: int = 256         # nested parentheses
    max_repetition: int = 10_000         # m and n in x{m,n}
    max_nfa_states: int = 2_000_000      # byte-automaton states after expanding repetitions
    max_inline_states: int = 16_384      # a rule larger than this stays a call instead of being inlined
    max_rule_states: int = 2_000_000     # inlining stops before a rule grows past this
    max_stack_depth: int = 2_048         # nested rule calls while matching
    max_stacks: int = 128                # parallel parses kept (ambiguity) while matching
    max_dfa_states: int = 100_000        # lazily built automaton states per compiled grammar (~1 KB each)

    def __post_init__(self):
        for name in self.__slots__:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GrammarLimits.{name} must be a positive int, got {value!r}")
