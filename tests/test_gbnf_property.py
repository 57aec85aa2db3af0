"""Property tests: random grammars against an independent Earley recognizer written here.

For every random grammar the engine accepts, a random walk over a small vocabulary (with
multi-byte and split UTF-8 tokens) checks at each step that the mask is exactly the set of
tokens after which the text is still a prefix of some sentence (per Earley), that
end-of-generation is allowed exactly when the text is a whole sentence, and that the mask
agrees with accept_token on a fork. Grammars the engine rejects must be left-recursive or
unproductive by this file's own analysis.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from ember.gbnf import Grammar, GrammarError, TokenVocab

ALPHA = "abé("
VOCAB_TEXTS = ["a", "b", "é", "(", "x", ")", "ab", "ba", "aa", "a(", "(a", "bé", "éa", "(b", "abb", "bab", "(((", "aéb",
               "))", "a)", ")(", "é)", ")a)", '"', 'a"', '"a', 'ab"', '"(']
VOCAB = [t.encode() for t in VOCAB_TEXTS] + [b"\xc3", b"\xa9", b"\xa9a", b"<s>", b"</s>"]
SPECIAL, EOG = len(VOCAB) - 2, len(VOCAB) - 1
_vocab = None


def vocab() -> TokenVocab:
    global _vocab
    if _vocab is None:
        _vocab = TokenVocab(VOCAB, special_ids=[SPECIAL], eog_ids=[EOG])
    return _vocab


# --- random grammars: ('lit', s) ('cls', chars, negated) ('any',) ('ref', i) ('seq', xs) ('alt', xs) ('rep', x, m, n)

leaves = st.one_of(
    st.text(alphabet=ALPHA + ")", min_size=0, max_size=3).map(lambda s: ("lit", s)),
    st.text(alphabet=ALPHA, min_size=1, max_size=2).map(lambda s: ("lit", s)),
    st.tuples(st.sets(st.sampled_from(ALPHA), min_size=1, max_size=3), st.booleans())
      .map(lambda t: ("cls", "".join(sorted(t[0])), t[1])),
    st.integers(0, 3).map(lambda i: ("ref", i)),
    st.just(("any",)),
)
exprs = st.recursive(leaves, lambda kids: st.one_of(
    st.lists(kids, min_size=1, max_size=3).map(lambda xs: ("seq", xs)),
    st.lists(kids, min_size=2, max_size=3).map(lambda xs: ("alt", xs)),
    st.tuples(kids, st.sampled_from([(0, None), (1, None), (0, 1), (2, 2), (1, 3), (0, 2)]))
      .map(lambda t: ("rep", t[0], *t[1])),
), max_leaves=7)
grammars = st.lists(exprs, min_size=1, max_size=4)


def render(e, n: int) -> str:
    kind = e[0]
    if kind == "lit":
        return json.dumps(e[1], ensure_ascii=False)
    if kind == "cls":
        return "[" + ("^" if e[2] else "") + e[1] + "]"
    if kind == "any":
        return "."
    if kind == "ref":
        return f"r{e[1] % n}"
    if kind == "seq":
        return "(" + " ".join(render(x, n) for x in e[1]) + ")"
    if kind == "alt":
        return "(" + " | ".join(render(x, n) for x in e[1]) + ")"
    m, hi = e[2], e[3]
    return "(" + render(e[1], n) + ")" + ("{%d,}" % m if hi is None else "{%d,%d}" % (m, hi))


def gbnf(rules: list) -> str:
    return "root ::= r0\n" + "\n".join(f"r{i} ::= {render(e, len(rules))}" for i, e in enumerate(rules))


# --- the rules as a plain context-free grammar: nonterminal -> productions of symbols

class CFG:
    def __init__(self, rules: list):
        self.prods: dict[str, list[tuple]] = {}
        self.count = 0
        n = len(rules)
        for i, e in enumerate(rules):
            self.prods[f"r{i}"] = [(self.symbol(e, n),)]
        self.prods["root"] = [(("N", "r0"),)]
        self.nullable = self._nullable()

    def fresh(self, prods: list[tuple]) -> tuple:
        self.count += 1
        name = f"_{self.count}"
        self.prods[name] = prods
        return ("N", name)

    def symbol(self, e, n: int) -> tuple:
        kind = e[0]
        if kind == "lit":
            return self.fresh([tuple(("T", {c}, False) for c in e[1])])
        if kind == "cls":
            return ("T", set(e[1]), e[2])
        if kind == "any":
            return ("T", set(), True)
        if kind == "ref":
            return ("N", f"r{e[1] % n}")
        if kind == "seq":
            return self.fresh([tuple(self.symbol(x, n) for x in e[1])])
        if kind == "alt":
            return self.fresh([(self.symbol(x, n),) for x in e[1]])
        x, m, hi = self.symbol(e[1], n), e[2], e[3]
        if hi is None:
            star = self.fresh([()])
            self.prods[star[1]].append((x, star))
            tail = star
        else:
            tail = self.fresh([()])
            for _ in range(hi - m):
                tail = self.fresh([(), (x, tail)])
        return self.fresh([(x,) * m + (tail,)])

    def _nullable(self) -> set:
        nullable, changed = set(), True
        while changed:
            changed = False
            for lhs, prods in self.prods.items():
                if lhs not in nullable and any(all(s[0] == "N" and s[1] in nullable for s in p) for p in prods):
                    nullable.add(lhs)
                    changed = True
        return nullable

    def left_recursive(self) -> bool:
        graph = {lhs: set() for lhs in self.prods}
        for lhs, prods in self.prods.items():
            for p in prods:
                for s in p:
                    if s[0] == "T":
                        break
                    graph[lhs].add(s[1])
                    if s[1] not in self.nullable:
                        break
        for start in [s for s in graph if s[0] == "r"]:  # a rule reaching itself (repetitions are loops)
            seen, todo = set(), list(graph[start])
            while todo:
                x = todo.pop()
                if x == start:
                    return True
                if x not in seen:
                    seen.add(x)
                    todo.extend(graph[x])
        return False

    def unproductive(self) -> bool:
        good, changed = set(), True
        while changed:
            changed = False
            for lhs, prods in self.prods.items():
                if lhs not in good and any(all(s[0] == "T" or s[1] in good for s in p) for p in prods):
                    good.add(lhs)
                    changed = True
        return "root" not in good or any(f"r{i}" not in good for i in range(len(self.prods)) if f"r{i}" in self.prods)


class Earley:
    """Chart parser over code points; extend() adds columns, so prefixes share work."""

    def __init__(self, cfg: CFG):
        self.cfg = cfg
        self.columns = [self._close({("root", 0, 0, 0)}, 0, [])]

    def _close(self, items: set, i: int, columns: list) -> set:
        todo = list(items)
        while todo:
            lhs, pi, dot, org = todo.pop()
            rhs = self.cfg.prods[lhs][pi]
            new = []
            if dot < len(rhs) and rhs[dot][0] == "N":
                sym = rhs[dot][1]
                new += [(sym, k, 0, i) for k in range(len(self.cfg.prods[sym]))]
                if sym in self.cfg.nullable:
                    new.append((lhs, pi, dot + 1, org))
            elif dot == len(rhs):
                source = items if org == i else columns[org]
                for (l2, p2, d2, o2) in list(source):
                    r2 = self.cfg.prods[l2][p2]
                    if d2 < len(r2) and r2[d2] == ("N", lhs):
                        new.append((l2, p2, d2 + 1, o2))
            for it in new:
                if it not in items:
                    items.add(it)
                    todo.append(it)
        return items

    def extend(self, chars: str) -> Earley:
        out = Earley.__new__(Earley)
        out.cfg, out.columns = self.cfg, list(self.columns)
        for ch in chars:
            i = len(out.columns)
            moved = set()
            for (lhs, pi, dot, org) in out.columns[-1]:
                rhs = self.cfg.prods[lhs][pi]
                if dot < len(rhs) and rhs[dot][0] == "T":
                    _, chars_, negated = rhs[dot]
                    if (ch in chars_) != negated:
                        moved.add((lhs, pi, dot + 1, org))
            out.columns.append(out._close(moved, i, out.columns))
        return out

    @property
    def viable(self) -> bool:
        return bool(self.columns[-1])

    @property
    def complete(self) -> bool:
        return ("root", 0, 1, 0) in self.columns[-1]


def viable_bytes(state: Earley, pending: bytes, data: bytes) -> bool:
    """Whether pending + data (UTF-8, maybe cut mid-character) can still be a sentence prefix."""
    raw = pending + data
    cut = split_utf8(raw)
    if cut is None:
        return False
    head, tail = raw[:cut], raw[cut:]
    if not tail:
        return state.extend(head.decode("utf-8")).viable
    grown = state.extend(head.decode("utf-8"))
    if not grown.viable:
        return False
    for cont in range(0x80, 0xC0):  # two-byte characters suffice: the alphabet has no longer ones
        try:
            ch = (tail + bytes([cont])).decode("utf-8")
        except UnicodeDecodeError:
            continue
        if grown.extend(ch).viable:
            return True
    return False


def split_utf8(raw: bytes) -> int | None:
    """Length of the longest valid UTF-8 head, when the rest is a cut-off character; else None."""
    try:
        raw.decode("utf-8")
        return len(raw)
    except UnicodeDecodeError as e:
        if e.end != len(raw) or e.reason != "unexpected end of data":
            return None
        return e.start


def mask_tokens(m) -> set[int]:
    return set(m.allowed_tokens().tolist())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rules=grammars, seed=st.integers(0, 2**31 - 1))
def test_masks_match_an_independent_recognizer(rules, seed):
    text = gbnf(rules)
    cfg = CFG(rules)
    try:
        grammar = Grammar.parse(text)
    except GrammarError as e:  # must be a real defect of the grammar
        assert cfg.left_recursive() or cfg.unproductive(), (text, str(e))
        event("rejected grammar")
        return
    assert not cfg.left_recursive(), text
    walk_against_earley(grammar, cfg, text, seed, steps=6)


def lit(s):
    return ("lit", s)


def seq(*xs):
    return ("seq", list(xs))


def alt(*xs):
    return ("alt", list(xs))


FIXED = {  # rules that stay calls (tokens like "))" cross returns), and loops and chains that use slices
    "parens": [alt(seq(lit("("), ("ref", 0), lit(")")), lit("a"))],
    "lists": [("rep", seq(lit("("), ("ref", 1), lit(")")), 0, None), alt(seq(("ref", 0), ("rep", lit("b"), 0, 1)), lit("é"))],
    "mutual": [alt(seq(lit("a"), ("ref", 1)), lit("")), seq(lit("("), ("ref", 0), lit(")"), ("ref", 0))],
    "nested any": [alt(seq(lit("("), ("rep", ("ref", 0), 0, 2), lit(")")), ("cls", "()", True))],
    "quoted loop": [seq(lit('"'), ("rep", ("cls", '"', True), 0, None), lit('"'), ("rep", ("ref", 0), 0, 1))],
    "quoted chain": [seq(lit('"'), ("rep", ("cls", '"', True), 0, 2), lit('"'), ("rep", lit("a"), 0, 1))],
    "quoted call": [seq(lit("("), ("rep", ("ref", 1), 0, 2), lit(")")), seq(lit('"'), ("rep", ("any",), 1, 2), lit('"'))],
}


@pytest.mark.parametrize("name", list(FIXED))
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_recursive_grammars_match_the_recognizer(name, seed):
    rules = FIXED[name]
    text = gbnf(rules)
    walk_against_earley(Grammar.parse(text), CFG(rules), text, seed, steps=10)


def walk_against_earley(grammar, cfg, text, seed, steps):
    m = grammar.compile(vocab()).matcher()
    rng = np.random.default_rng(seed)
    state, pending, produced = Earley(cfg), b"", b""
    for _ in range(steps):
        if m.saturated:  # parses were dropped (a hugely ambiguous grammar): masks no longer complete
            event("saturated")
            break
        allowed = mask_tokens(m)
        expected = {t for t in range(len(VOCAB)) if t not in (SPECIAL, EOG) and viable_bytes(state, pending, VOCAB[t])}
        if not pending and state.complete:
            expected.add(EOG)
        assert allowed == expected, (text, produced, sorted(allowed ^ expected))
        for t in rng.permutation(len(VOCAB))[:6]:  # accept_token agrees with the mask
            assert m.fork().accept_token(int(t)) == (int(t) in allowed), (text, produced, t)
        choices = sorted(allowed - {EOG})
        if not choices:  # the grammar may need bytes no token of this small vocabulary has
            break
        event("walked a step")
        t = int(rng.choice(choices))
        assert m.accept_token(t)
        produced += VOCAB[t]
        raw = pending + VOCAB[t]
        cut = split_utf8(raw)
        state, pending = state.extend(raw[:cut].decode("utf-8")), raw[cut:]
        assert state.viable


@settings(max_examples=60, deadline=None)
@given(rules=grammars, seed=st.integers(0, 2**31 - 1))
def test_forks_are_independent_and_accept_bytes_matches_tokens(rules, seed):
    try:
        grammar = Grammar.parse(gbnf(rules))
    except GrammarError:
        return
    m = grammar.compile(vocab()).matcher()
    rng = np.random.default_rng(seed)
    for _ in range(4):
        choices = sorted(mask_tokens(m) - {EOG})
        if not choices:
            break
        t = int(rng.choice(choices))
        before = mask_tokens(m)
        f = m.fork()
        assert f.accept_token(t)
        assert mask_tokens(m) == before  # the fork moved, the original did not
        g = m.fork()
        assert g.accept_bytes(VOCAB[t])
        assert mask_tokens(g) == mask_tokens(f) and g.can_end == f.can_end
        m = f
