"""GBNF parsing: the syntax, exact semantics of escapes and classes, errors with positions,
and the hostile corpus (each must fail fast with a clear message)."""
from __future__ import annotations


import pytest

from work import count_calls
from ember.gbnf import Grammar, GrammarError, GrammarLimits
from ember.gbnf.syntax import Alt, Chars, Literal, Ref, Repeat, Seq, Token


def body(text: str, rule: str = "root"):
    return Grammar.parse(text).rules[rule].body


def test_rules_literals_classes_and_groups():
    g = Grammar.parse('root ::= "a" [b-d] ( x | "y" )* # comment\nx ::= [^\\n]\n')
    assert list(g.rules) == ["root", "x"]
    assert body('root ::= "a" [b-d] ( x | "y" )*\nx ::= "z"') == Seq((
        Literal(b"a"), Chars(((ord("b"), ord("d")),)),
        Repeat(Alt((Ref("x", 21), Literal(b"y"))), 0, None)))


@pytest.mark.parametrize("src, data", [
    (r'"\x41\u00e9\U0001F600"', "Aé😀".encode()),
    (r'"\n\t\r\\\"\[\]\-"', b'\n\t\r\\"[]-'),
    ('"é€"', "é€".encode()),
    ('""', b""),
])
def test_literal_escapes(src, data):
    node = body(f"root ::= {src}")
    assert (node.data if isinstance(node, Literal) else b"") == data


def test_class_ranges_negation_and_dash():
    assert body(r"root ::= [a-c\]\-x]").ranges == ((0x2D, 0x2D), (0x5D, 0x5D), (0x61, 0x63), (0x78, 0x78))
    assert body("root ::= [a-]").ranges == ((0x2D, 0x2D), (0x61, 0x61))
    neg = body(r'root ::= [^"\\]').ranges
    assert neg[0] == (0, 0x21) and neg[1] == (0x23, 0x5B) and (0x5D, 0xD7FF) in neg and neg[-1] == (0xE000, 0x10FFFF)
    assert body("root ::= .").ranges == ((0, 0xD7FF), (0xE000, 0x10FFFF))  # any character, no surrogates


def test_repetitions_and_tokens():
    assert body('root ::= "a"{2} "b"{1,} "c"{0,3} "d"?') == Seq((
        Repeat(Literal(b"a"), 2, 2), Repeat(Literal(b"b"), 1, None), Repeat(Literal(b"c"), 0, 3),
        Repeat(Literal(b"d"), 0, 1)))
    assert body("root ::= <[12]> !<think> <|im_end|>") == Seq((
        Token(12, False, 9), Token("<think>", True, 16), Token("<|im_end|>", False, 25)))


def test_newlines_inside_groups_and_after_bar():
    g = Grammar.parse('root ::= (\n  "a"\n  | "b"\n) |\n  "c"\nother ::= "d"\n', root="root")
    assert set(g.rules) == {"root", "other"}


def test_bytes_input_and_root_choice():
    g = Grammar.parse('start ::= "é"'.encode(), root="start")
    assert g.rules["start"].body == Literal("é".encode())


@pytest.mark.parametrize("text, message, line, col", [
    ('root ::= "abc', "unterminated string literal", 1, 10),
    ("root ::= [abc", "unterminated character class", 1, 10),
    (r'root ::= "a\q"', "invalid escape '\\q'", 1, 12),
    (r'root ::= "\x4"', "invalid escape", 1, 11),
    ("root ::= []", "empty character class", 1, 10),
    ("root ::= [z-a]", "reversed", 1, 12),
    ('root ::= "a"\nroot ::= "b"', "defined twice", 2, 1),
    ("root ::= x", "undefined rule 'x'", 1, 10),
    ('root ::= ("a"', "unclosed '('", 1, 10),
    ('root ::= "a")', "unmatched ')'", 1, 13),
    ("root ::= *", "nothing to repeat", 1, 10),
    ('root ::= "a"{3,1}', "maximum is below the minimum", 1, 13),
    ('root ::= "a"{x}', "malformed repetition", 1, 13),
    ('root "a"', "expected '::='", 1, 6),
    ('root ::= "a" $', "unexpected '$'", 1, 14),
    (r'root ::= "\U00110000"', "beyond U+10FFFF", 1, 11),
    (r'root ::= "\ud800"', "surrogate", 1, 11),
    ("root ::= <abc", "unterminated token reference", 1, 10),
    ("root ::= !x", "must be followed by a token reference", 1, 10),
])
def test_errors_carry_line_and_column(text, message, line, col):
    with pytest.raises(GrammarError) as e:
        Grammar.parse(text)
    assert message in str(e.value)
    assert (e.value.line, e.value.column) == (line, col)


def test_grammar_level_errors():
    with pytest.raises(GrammarError, match="empty grammar"):
        Grammar.parse("  # only a comment\n")
    with pytest.raises(GrammarError, match="no rule 'root'"):
        Grammar.parse('other ::= "a"')
    with pytest.raises(GrammarError, match="can never finish"):
        Grammar.parse('root ::= "a" root')
    with pytest.raises(GrammarError, match="not valid UTF-8") as e:
        Grammar.parse(b'root ::= "a"\nx ::= "\xff"')
    assert (e.value.line, e.value.column) == (2, 8)
    with pytest.raises(GrammarError, match="lone surrogate"):
        Grammar.parse('root ::= "\ud800"')


@pytest.mark.parametrize("text, cycle", [
    ('root ::= root "a" | "b"', "root -> root"),
    ('root ::= a\na ::= b "x"\nb ::= a | "y"', "a -> b -> a"),
    ('root ::= n root "x" | "y"\nn ::= "z"?', "root -> root"),      # through a nullable prefix
    ('root ::= ("" | "q")* root "x" | "y"', "root -> root"),       # through a nullable group
])
def test_left_recursion_is_rejected_with_the_cycle(text, cycle):
    with pytest.raises(GrammarError, match="left recursion") as e:
        Grammar.parse(text)
    assert cycle in str(e.value)


def test_right_recursion_and_recursion_after_input_are_fine():
    Grammar.parse('root ::= "a" root | "b"')
    Grammar.parse('root ::= "(" root ")" | ""')


HOSTILE = {
    "deep parentheses": "root ::= " + "(" * 100_000 + '"a"' + ")" * 100_000,
    "deep unclosed": "root ::= " + "(" * 100_000,
    "huge repetition": 'root ::= "x"{1000000}',
    "huge open repetition": 'root ::= "x"{1000000,}',
    "nested repetition product": 'root ::= ((("ab"{100}){100}){100})',
    "direct left recursion": 'root ::= root "a"',
    "indirect left recursion": "root ::= a\na ::= b\nb ::= c\nc ::= a \"x\" | \"y\"",
    "unterminated literal": 'root ::= "' + "a" * 100_000,
    "unterminated class": "root ::= [" + "a" * 100_000,
    "invalid escape": r'root ::= "\z"',
    "invalid UTF-8": b'root ::= "\xc3\x28"',
    "undefined rule": "root ::= " + " ".join(f"r{i}" for i in range(10_000)),
    "empty grammar": "",
    "too many rules": "\n".join(f"r{i} ::= \"a\"" for i in range(30_000)) + "\nroot ::= r0",
    "too many alternatives": "root ::= " + " | ".join('"a"' for _ in range(30_000)),
    "too long": "root ::= " + '"a" ' * 2_000_000,
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_grammars_fail_fast(name):
    """Refused after a few calls per character of the grammar (a quadratic or exponential parse of
    these inputs would make millions more)."""
    text = HOSTILE[name]
    error, calls = count_calls(lambda: Grammar.parse(text))
    assert isinstance(error, GrammarError) and str(error)
    assert calls <= 4 * len(text) + 1000, f"{name}: {calls} calls for {len(text)} characters"


def test_exponential_grammars_stay_small():
    # a30 doubles a29 thirty times: inlining must stop, not copy 2**30 times
    text = "root ::= a30\na0 ::= \"x\"\n" + "\n".join(f"a{i} ::= a{i - 1} a{i - 1}" for i in range(1, 31))
    g, calls = count_calls(lambda: Grammar.parse(text))
    assert g.program.n_nodes < 200_000 and calls <= 20 * len(text)
    # ambiguous alternations of the same literal parse in linear size
    g = Grammar.parse("root ::= " + " ".join('("a" | "a" | "a")' for _ in range(500)))
    assert g.program.n_nodes < 20_000


def test_limits_are_configurable_and_validated():
    tight = GrammarLimits(max_nesting_depth=3, max_repetition=5, max_rules=2)
    with pytest.raises(GrammarError, match="nested deeper than 3"):
        Grammar.parse('root ::= (((("a"))))', limits=tight)
    with pytest.raises(GrammarError, match="exceeds the limit of 5"):
        Grammar.parse('root ::= "a"{6}', limits=tight)
    with pytest.raises(GrammarError, match="more than 2 rules"):
        Grammar.parse('root ::= "a"\nb ::= "b"\nc ::= "c"', limits=tight)
    with pytest.raises(ValueError):
        GrammarLimits(max_rules=0)
