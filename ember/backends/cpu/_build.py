"""cffi build script for the CPU kernels: compiled once at install time.

Every `csrc/api_*.h` declares the functions Python may call (plain C, parsed by
cffi); every `csrc/*.c` is compiled into one extension, `_ember_cpu`. Each SIMD
variant lives in its own file and enables its instruction set with a pragma, so
one build runs on any CPU of the architecture and picks its path at load time.
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
        sys.exit(
            f"ember: no C compiler found (looked for '{cc}'). ember builds its CPU kernels at install "
            "time; install gcc or clang (e.g. 'apt install gcc' or 'xcode-select --install') and "
            "run the install again, or install a prebuilt ember wheel."
        )


def _relative(p: Path) -> str:
    # setuptools wants source paths relative to the project root.
    root = CSRC.parents[3]
    try:
        return str(p.relative_to(root))
    except ValueError:
        return str(p)


def build_ffi() -> FFI:
    headers = sorted(CSRC.glob("api_*.h"))
    sources = sorted(CSRC.glob("*.c"))
    ffi = FFI()
    ffi.cdef("\n".join(h.read_text() for h in headers))
    extra = ["-O3", "-std=gnu11", "-fno-math-errno", "-fno-trapping-math", "-pthread"]
    ffi.set_source(
        "ember.backends.cpu._ember_cpu",
        "\n".join(f'#include "{h.name}"' for h in headers),
        sources=[_relative(s) for s in sources],
        include_dirs=[str(CSRC)],
        extra_compile_args=extra,
        extra_link_args=["-pthread", "-lm"],
    )
    return ffi


_check_compiler()
ffibuilder = build_ffi()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
