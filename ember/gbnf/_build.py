"""cffi build script for the grammar engine: its own extension, `ember.gbnf._ember_gbnf`.

`csrc/api_gbnf.h` declares what Python may call; every `csrc/*.c` is compiled in.
"""
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from cffi import FFI

CSRC = Path(__file__).resolve().parent / "csrc"


def _check_compiler() -> None:
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        sys.exit(f"ember: no C compiler found (looked for '{cc}'); the grammar engine is built at install time.")


def _relative(p: Path) -> str:
    root = CSRC.parents[2]  # setuptools wants paths relative to the project root
    try:
        return str(p.relative_to(root))
    except ValueError:
        return str(p)


def build_ffi() -> FFI:
    ffi = FFI()
    ffi.cdef((CSRC / "api_gbnf.h").read_text())
    ffi.set_source(
        "ember.gbnf._ember_gbnf",
        '#include "api_gbnf.h"',
        sources=[_relative(s) for s in sorted(CSRC.glob("*.c"))],
        include_dirs=[str(CSRC)],
        extra_compile_args=["-O2", "-std=gnu11", "-pthread", "-Wall", "-Wno-unused-function"],
        extra_link_args=["-pthread"],
    )
    return ffi


_check_compiler()
ffibuilder = build_ffi()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
