"""Loads the compiled CPU kernels (`_ember_cpu`, built by `_build.py` at install)."""
try:
    from ._ember_cpu import ffi, lib  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError(
        "ember's CPU kernels are not built (the extension ember.backends.cpu._ember_cpu is missing). "
        "Reinstall ember with a C compiler available: pip install --force-reinstall --no-deps ."
    ) from e
