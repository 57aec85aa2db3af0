"""Stop strings as the text streams: the same results as searching the whole held-back text after
every piece, for a work that grows with the new text, not with the stop strings' length."""
from __future__ import annotations

import random

from ember.engine.stops import StopMatcher


def naive(stops: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    """The definition: after each piece, search the held-back text plus the piece for every stop
    string (the earliest start wins); otherwise hold back the longest end that begins one."""
    stops = [s for s in stops if s]
    held, sent = "", []
    for piece in pieces:
        buf = held + piece
        cut = min((i for i in (buf.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            sent.append(buf[:cut])
            return sent, True, ""
        keep = max((k for s in stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        held = buf[len(buf) - keep:]
        sent.append(buf[:len(buf) - keep])
    return sent, False, held


def streamed(stops: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    m = StopMatcher(stops)
    sent = []
    for piece in pieces:
        text, stopped = m.feed(piece)
        sent.append(text)
        if stopped:
            return sent, True, ""
    return sent, False, m.flush()


def random_case(rng: random.Random, alphabet: str) -> tuple[list[str], list[str]]:
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 9))) for _ in range(rng.randrange(1, 5))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
    if stops[0] and rng.random() < 0.5:  # often plant an occurrence, or a long partial one
        at = rng.randrange(len(text) + 1)
        text = text[:at] + stops[0][:rng.randrange(1, len(stops[0]) + 1)] + text[at:]
    pieces, i = [], 0
    while i < len(text):
        n = rng.choice([0, 1, 1, 2, 3, 7])
        pieces.append(text[i:i + n])
        i += n
    return stops, pieces


def test_streamed_equals_the_definition_on_random_cases():
    """Overlapping stop strings over small alphabets (borders, one string inside another, several
    complete after one piece), pieces of 0 to 7 characters, non-ASCII text."""
    rng = random.Random(3)
    stopped = 0
    for alphabet in ("ab", "abc", "aab", "é✓a", "abcdefgh"):
        for _ in range(3000):
            stops, pieces = random_case(rng, alphabet)
            got = streamed(stops, pieces)
            assert got == naive(stops, pieces), (stops, pieces)
            assert "".join(got[0]) + got[2] in "".join(pieces)  # nothing invented, in order
            stopped += got[1]
    assert stopped > 3000  # both outcomes are well covered


def test_earliest_start_wins_and_text_is_cut_before_it():
    assert streamed(["abcd", "bc"], ["xabcdy"]) == (["x"], True, "")  # both complete: "abcd" starts first
    assert streamed(["abcd", "bc"], ["xab", "c", "d"]) == (["x", "a"], True, "")  # "bc" completes first
    assert streamed(["</s>"], ["Hello <", "/", "s", "> more"]) == (["Hello ", "", "", ""], True, "")
    assert streamed(["ab"], ["a", "a", "c"]) == (["", "a", "ac"], False, "")


def test_work_grows_with_the_text_not_with_the_stop_strings():
    """16 stop strings of 300,000 characters that the text follows all the way (the most it can
    hold back: nothing is sent for 2,500 characters), fed one short piece at a time: the characters
    examined stay within a small constant per new character and stop string (a search of every
    held-back length after each piece examined about the stop strings' length per piece)."""
    rng = random.Random(1)
    text = "".join(rng.choice("ab ") for _ in range(3000))
    stops = [text[:1000 + 100 * i] + "x" * 300_000 for i in range(16)]
    m = StopMatcher(stops)
    fed, sent = 0, []
    for i in range(0, len(text), 4):
        piece = text[i:i + 4]
        out, stopped = m.feed(piece)
        assert not stopped and (out == "" or fed >= 2500)
        sent.append(out)
        fed += len(piece)
        assert m.work <= 4 * fed * len(stops)
    assert "".join(sent) + m.flush() == text


def test_a_long_held_back_text_is_released_a_little_at_a_time_for_little_work():
    """A stop string "a" * K + "b" and a text of many "a"s: after K of them the text holds back K
    characters and each new "a" releases one; the work per character stays constant."""
    m = StopMatcher(["a" * 5000 + "b"])
    out = []
    for _ in range(20000):
        text, stopped = m.feed("a")
        out.append(text)
    assert "".join(out) == "a" * 15000 and m.work <= 4 * 20000
    assert m.feed("ab") == ("a", True)
