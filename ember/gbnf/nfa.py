"""Rules -> checks -> the byte automaton (built natively from a compact postfix encoding).

Each rule is encoded as a postfix program (csrc/api_gbnf.h, eg_nfa_input): literals as bytes,
character classes as small UTF-8 automata, references, token references, sequences,
alternatives and repetitions. The checks run here, on those programs, with no recursion
(nesting can be deep): undefined rules were caught by the parser; left recursion (a rule
reaching itself before consuming anything, through nullable prefixes too), and rules that can
never finish are errors.

Inlining: a rule that does not recurse is copied into its callers when that stays small, so
most grammars (JSON schemas above all) become one automaton whose state after any prefix does
not depend on a stack, and whose token masks can be computed once and reused. The copies a
rule would cost are counted through its callers (a rule used at many places of a rule that is
itself copied many times stays a call), so grammars whose rules form a DAG do not unfold into
a tree.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import GrammarError, GrammarLimits, error_at
from .syntax import Alt, Chars, Literal, Ref, Repeat, Rule, Seq, Token
from .utf8 import class_fragment

OP_LIT, OP_CLASS, OP_REF, OP_TOKEN, OP_SEQ, OP_ALT, OP_REP = range(1, 8)
ALWAYS_INLINE = 256         # automaton states: rules this small are copied wherever used
INLINE_TOTAL = 200_000      # states all copies of one rule may add up to


@dataclass(slots=True)
class Program:
    """The checked automaton, owned by the native engine (vocabulary-independent)."""
    nfa: object                  # eg_nfa pointer (freed with the object)
    rule_names: list[str]        # rules still called, root first
    tokens: list[Token]          # token references, by token-set id
    n_nodes: int
    n_edges: int


class Encoder:
    """Byte sets, class automata and token references shared by all rules of a grammar."""

    def __init__(self):
        self.set_index: dict[int, int] = {}
        self.sets: list[int] = []
        self.class_index: dict[tuple, int] = {}
        self.class_data: list[list[int]] = []
        self.class_sizes: list[int] = []
        self.tokens: list[Token] = []

    def set_id(self, bits: int) -> int:
        i = self.set_index.get(bits)
        if i is None:
            i = self.set_index[bits] = len(self.sets)
            self.sets.append(bits)
        return i

    def class_id(self, ranges: tuple) -> int:
        i = self.class_index.get(ranges)
        if i is None:
            n, edges = class_fragment(ranges)
            data = [n, len(edges)]
            for s, bits, d in edges:
                data += (s, self.set_id(bits), d)
            i = self.class_index[ranges] = len(self.class_data)
            self.class_data.append(data)
            self.class_sizes.append(n)
        return i


@dataclass(slots=True)
class RuleCode:
    ops: list[int]
    size: int                    # automaton states with every reference as a call
    uses: dict[int, int]         # callee -> how many copies of its reference repetition makes


def encode(body, index: dict[str, int], enc: Encoder, cap: int) -> RuleCode:
    """Postfix program of one rule, its size and its references (explicit stack, no recursion)."""
    ops: list[int] = []
    sizes: list[int] = []
    uses: dict[int, int] = {}
    todo = [(body, False, 1)]
    while todo:
        e, expanded, factor = todo.pop()
        if isinstance(e, Literal):
            ops += (OP_LIT, len(e.data), *(enc.set_id(1 << b) for b in e.data))
            sizes.append(len(e.data) + 1)
        elif isinstance(e, Chars):
            c = enc.class_id(e.ranges)
            ops += (OP_CLASS, c)
            sizes.append(enc.class_sizes[c])
        elif isinstance(e, Ref):
            q = index[e.name]
            ops += (OP_REF, q)
            uses[q] = min(uses.get(q, 0) + factor, cap)
            sizes.append(2)
        elif isinstance(e, Token):
            ops += (OP_TOKEN, len(enc.tokens))
            enc.tokens.append(e)
            sizes.append(2)
        elif not expanded:
            todo.append((e, True, factor))
            kids = e.items if isinstance(e, Seq) else e.options if isinstance(e, Alt) else (e.item,)
            inner = factor * copies(e) if isinstance(e, Repeat) else factor
            todo.extend((k, False, min(inner, cap)) for k in reversed(kids))
        elif isinstance(e, Repeat):
            ops += (OP_REP, e.min, -1 if e.max is None else e.max)
            sizes.append(min(sizes.pop() * copies(e) + 2, cap))
        else:
            n = len(e.items) if isinstance(e, Seq) else len(e.options)
            ops += (OP_SEQ if isinstance(e, Seq) else OP_ALT, n)
            total = sum(sizes[len(sizes) - n:]) + 2
            del sizes[len(sizes) - n:]
            sizes.append(min(total, cap))
    return RuleCode(ops, sizes[0], uses)


def copies(e: Repeat) -> int:
    return e.max if e.max is not None else max(e.min, 1)


# --- facts about the programs, by evaluating them with a value stack

def evaluate(ops: list[int], leaf, seq, alt, rep):
    """Folds a postfix program: leaf(op, arg) for terminals and references, combinators for the rest."""
    stack, i, n = [], 0, len(ops)
    while i < n:
        op = ops[i]
        if op == OP_LIT:
            stack.append(leaf(OP_LIT, ops[i + 1]))
            i += 2 + ops[i + 1]
        elif op in (OP_CLASS, OP_REF, OP_TOKEN):
            stack.append(leaf(op, ops[i + 1]))
            i += 2
        elif op == OP_REP:
            stack.append(rep(stack.pop(), ops[i + 1]))
            i += 3
        else:
            k = ops[i + 1]
            items = stack[len(stack) - k:]
            del stack[len(stack) - k:]
            stack.append(seq(items) if op == OP_SEQ else alt(items))
            i += 2
    return stack[0]


class Analysis:
    def __init__(self, text: str, rules: dict[str, Rule], names: list[str], code: list[RuleCode], enc: Encoder):
        self.text, self.rules, self.names, self.code, self.enc = text, rules, names, code, enc
        self.callers: list[set[int]] = [set() for _ in names]
        for r, c in enumerate(code):
            for q in c.uses:
                self.callers[q].add(r)
        self.nullable = self.fixpoint(self.is_nullable)
        self.productive = self.fixpoint(self.is_productive)

    def fixpoint(self, test) -> list[bool]:
        """Rules passing test, re-testing the callers of each rule that joins (a worklist)."""
        result = [False] * len(self.names)
        work = list(range(len(self.names)))
        while work:
            r = work.pop()
            if not result[r] and test(r, result):
                result[r] = True
                work.extend(self.callers[r])
        return result

    def is_nullable(self, r: int, nullable: list[bool]) -> bool:
        leaf = lambda op, arg: (arg == 0) if op == OP_LIT else nullable[arg] if op == OP_REF else False
        return evaluate(self.code[r].ops, leaf, all, any, lambda v, m: m == 0 or v)

    def is_productive(self, r: int, productive: list[bool]) -> bool:
        sizes = self.enc.class_data
        leaf = lambda op, arg: (productive[arg] if op == OP_REF else sizes[arg][1] > 0 if op == OP_CLASS else True)
        return evaluate(self.code[r].ops, leaf, all, any, lambda v, m: m == 0 or v)

    def left_calls(self, r: int) -> set[int]:
        """Rules r may call before consuming anything."""
        nullable = self.nullable

        def leaf(op, arg):
            if op == OP_REF:
                return {arg}, nullable[arg]
            return set(), op == OP_LIT and arg == 0

        def seq(items):
            calls: set[int] = set()
            for c, n in items:
                calls |= c
                if not n:
                    return calls, False
            return calls, True

        def alt(items):
            return set().union(*(c for c, _ in items)), any(n for _, n in items)

        return evaluate(self.code[r].ops, leaf, seq, alt, lambda v, m: (v[0], m == 0 or v[1]))[0]

    def check(self, root: int) -> None:
        cycle = find_cycle({r: sorted(self.left_calls(r)) for r in range(len(self.names))})
        if cycle:
            path = " -> ".join(self.names[r] for r in cycle + [cycle[0]])
            raise self.error(cycle[0], f"left recursion: rule '{self.names[cycle[0]]}' can reach itself "
                                       f"without consuming input ({path})")
        for r in self.reachable(root):
            if not self.productive[r]:
                raise self.error(r, f"rule '{self.names[r]}' can never finish: every alternative needs itself "
                                    "again (or an empty character class)")

    def reachable(self, root: int) -> list[int]:
        seen, todo = {root}, [root]
        while todo:
            for q in self.code[todo.pop()].uses:
                if q not in seen:
                    seen.add(q)
                    todo.append(q)
        return sorted(seen)

    def error(self, r: int, message: str) -> GrammarError:
        return error_at(self.text, self.rules[self.names[r]].at, message)


def find_cycle(graph: dict[int, list[int]]) -> list[int] | None:
    """Some cycle of a directed graph as a node list, by iterative depth-first search."""
    state: dict[int, int] = {}  # 1 on the current path, 2 finished
    for start in graph:
        if start in state:
            continue
        path, iters = [start], [iter(graph[start])]
        state[start] = 1
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(graph.get(nxt, ())))
    return None


def strongly_connected(graph: list[list[int]]) -> list[list[int]]:
    """Components, callees before callers (iterative Kosaraju)."""
    n = len(graph)
    order, seen = [], [False] * n
    for s in range(n):
        if seen[s]:
            continue
        seen[s] = True
        stack = [(s, iter(graph[s]))]
        while stack:
            v, it = stack[-1]
            w = next(it, None)
            if w is None:
                order.append(v)
                stack.pop()
            elif not seen[w]:
                seen[w] = True
                stack.append((w, iter(graph[w])))
    reverse: list[list[int]] = [[] for _ in range(n)]
    for v, ws in enumerate(graph):
        for w in ws:
            reverse[w].append(v)
    comp, comps = [-1] * n, []
    for s in reversed(order):  # on the reversed graph components come out callers first
        if comp[s] >= 0:
            continue
        comp[s], members, todo = len(comps), [s], [s]
        while todo:
            for w in reverse[todo.pop()]:
                if comp[w] < 0:
                    comp[w] = comp[s]
                    members.append(w)
                    todo.append(w)
        comps.append(members)
    return comps[::-1]


# --- inlining and building

def inline_plan(a: Analysis, root: int, limits: GrammarLimits) -> tuple[list[int], list[bool]]:
    """(rules to build, callees first; per rule 0 call it, 1 copy it in, 2 copy it in at several places)."""
    comps = strongly_connected([sorted(c.uses) for c in a.code])
    reachable = set(a.reachable(root))
    order = [r for members in comps for r in members if r in reachable]
    recursive = [False] * len(a.names)
    for members in comps:
        for r in members:
            recursive[r] = len(members) > 1 or r in a.code[r].uses
    cap = limits.max_nfa_states + 1
    # copies of each rule if every non-recursive caller were copied too (callers first)
    sites = [0] * len(a.names)
    sites[root] = 1
    for r in reversed(order):
        weight = sites[r] if not recursive[r] and r != root else 1
        for q, k in a.code[r].uses.items():
            sites[q] = min(sites[q] + k * max(weight, 1), cap)
    inline, full = [0] * len(a.names), [0] * len(a.names)
    for r in order:  # callees first: a rule's size counts the callees copied into it
        full[r] = min(a.code[r].size + sum(k * full[q] for q, k in a.code[r].uses.items() if inline[q]), cap)
        copied = (r != root and not recursive[r] and full[r] <= limits.max_inline_states
                  and (full[r] <= ALWAYS_INLINE or full[r] * sites[r] <= INLINE_TOTAL))
        inline[r] = 0 if not copied else 2 if sites[r] > 1 else 1
    return order, inline


def build_program(text: str, rules: dict[str, Rule], root: str, limits: GrammarLimits) -> Program:
    from ._native import ffi, lib
    names = list(rules)
    index = {name: i for i, name in enumerate(names)}
    enc = Encoder()
    cap = limits.max_nfa_states + 1
    code = [encode(rules[n].body, index, enc, cap) for n in names]
    for r, c in enumerate(code):
        if c.size > limits.max_nfa_states:
            raise error_at(text, rules[names[r]].at, f"rule '{names[r]}' expands to more than "
                           f"{limits.max_nfa_states} automaton states (repetition counts multiply)")
    analysis = Analysis(text, rules, names, code, enc)
    analysis.check(index[root])
    order, inline = inline_plan(analysis, index[root], limits)
    return native_build(ffi, lib, text, rules, names, index[root], code, enc, analysis, order, inline, limits)


def native_build(ffi, lib, text, rules, names, root, code, enc, analysis, order, inline, limits) -> Program:
    ops = np.fromiter((x for c in code for x in c.ops), np.int32)
    rule_ops = np.zeros(len(code) + 1, np.int32)
    np.cumsum([len(c.ops) for c in code], out=rule_ops[1:])
    class_off = np.zeros(len(enc.class_data) + 1, np.int32)
    np.cumsum([len(d) for d in enc.class_data], out=class_off[1:])
    arrays = {
        "ops": ops, "rule_ops": rule_ops, "build_order": np.asarray(order, np.int32),
        "inline_rule": np.asarray(inline, np.uint8), "nullable": np.asarray(analysis.nullable, np.uint8),
        "sets": np.frombuffer(b"".join(b.to_bytes(32, "little") for b in enc.sets) or bytes(32), np.uint8),
        "class_off": class_off,
        "class_data": np.fromiter((x for d in enc.class_data for x in d), np.int32) if enc.class_data
        else np.zeros(1, np.int32),
    }
    inp = ffi.new("eg_nfa_input *")
    inp.n_rules, inp.root, inp.n_sets, inp.n_classes = len(code), root, len(enc.sets), len(enc.class_data)
    inp.n_build, inp.max_states, inp.max_rule_states = len(order), limits.max_nfa_states, limits.max_rule_states
    ctype = {"<i4": "int32_t[]", "|u1": "uint8_t[]"}
    for name, arr in arrays.items():
        setattr(inp, name, ffi.from_buffer(ctype[arr.dtype.str], arr))
    err, bad = ffi.new("char[256]"), ffi.new("int32_t *")
    nfa = lib.eg_nfa_build(inp, err, 256, bad)
    if nfa == ffi.NULL:
        msg = ffi.string(err).decode() or "could not build the grammar's automaton"
        if bad[0] >= 0:
            raise error_at(text, rules[names[bad[0]]].at, f"rule '{names[bad[0]]}': {msg}")
        raise GrammarError(msg)
    nfa = ffi.gc(nfa, lib.eg_nfa_free)
    called = ffi.new("int32_t[]", len(code))
    n = lib.eg_nfa_rules(nfa, called, len(code))
    return Program(nfa, [names[called[i]] for i in range(n)], enc.tokens, lib.eg_nfa_nodes(nfa), lib.eg_nfa_edges(nfa))
