"""cffi build script of the WebGPU backend's one native helper, `ember.backends.webgpu._ember_webgpu`:
a replayed step's dispatches encoded in one call (csrc/encode.c). It links nothing: wgpu-native's
functions are called through the addresses wgpu-py's binding gives at run time."""
from pathlib import Path

from cffi import FFI

CSRC = Path(__file__).resolve().parent / "csrc"


def build_ffi() -> FFI:
    ffi = FFI()
    ffi.cdef((CSRC / "api_webgpu.h").read_text().replace("#include <stdint.h>", ""))
    ffi.set_source(
        "ember.backends.webgpu._ember_webgpu",
        '#include "api_webgpu.h"',
        sources=[str((CSRC / "encode.c").relative_to(CSRC.parents[3]))],
        include_dirs=[str(CSRC)],
        extra_compile_args=["-O2", "-std=gnu11"],
    )
    return ffi


ffibuilder = build_ffi()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
