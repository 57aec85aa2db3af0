"""Loads the compiled grammar engine (`_ember_gbnf`, built by `_build.py` at install)."""
try:
    from ._ember_gbnf import ffi, lib  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError(
        "ember's grammar engine is not built (the extension ember.gbnf._ember_gbnf is missing). "
        "Rebuild with: python setup.py -q build_ext --inplace --force"
    ) from e
