"""Counting the work a call does, for tests that bound work instead of timing it: every Python
function and builtin called while it runs (in this thread), a number that does not depend on
the machine or its load."""
from __future__ import annotations

import sys
from typing import Any, Callable


def count_calls(fn: Callable[[], Any]) -> tuple[Any, int]:
    """fn()'s result (or the exception it raised, as the result) and the calls it made."""
    n = 0

    def profile(frame, event, arg):
        nonlocal n
        if event in ("call", "c_call"):
            n += 1

    sys.setprofile(profile)
    try:
        result = fn()
    except Exception as e:  # the caller decides whether it was expected
        result = e
    finally:
        sys.setprofile(None)
    return result, n
