"""Fill a CUDA kernel cache ahead of time, on a machine with NVRTC but no GPU.

Every module ember compiles at run time (ops, attention, sample, and the products of each weight
type) is compiled for sm_<arch> into DIR, under the names a GPU machine's start looks for; point
EMBER_KERNEL_CACHE at a copy of DIR there and no kernel is compiled at start. The NVRTC here must
be the version the GPU machine's CuPy uses (the cache key includes it).

    python bench/cuda_kernel_cache.py --arch 90 --out .devcarry/kernels
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# bench/cuda.py beside this file must not shadow NVIDIA's `cuda` package that CuPy imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ember.backends.cuda._kernels import ATT_TILE_DIMS, build_cubin  # noqa: E402
from ember.backends.cuda.ops import MATRIX_TYPES  # noqa: E402
from ember.backends.cuda.ops.experts import EXPERT_TYPES, experts_module  # noqa: E402
from ember.backends.cuda.ops.matmul import XS_TYPES  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="90", help="compute capability without the dot (H100/H200: 90)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", nargs="+", help="modules whose names start so (e.g. experts_)")
    args = ap.parse_args()
    modules = (["ops", "attention", "sample", "kv_quant"] + [f"attention_tile{hd}" for hd in ATT_TILE_DIMS]
               + [f"matmul_{int(t)}{part}" for t in sorted(MATRIX_TYPES) for part in ("", "_batch", "_occ", "_store")]
               + [f"matmul_{int(t)}_xs" for t in sorted(XS_TYPES)]
               + [experts_module(t) for t in sorted(EXPERT_TYPES)])  # the grouped expert products
    if args.only:
        modules = [m for m in modules if any(m.startswith(p) for p in args.only)]
    t0 = time.perf_counter()
    build = lambda m: build_cubin(m, args.arch, args.out)  # noqa: E731
    # the first alone: NVRTC loads its builtins library on first use, which failed here when two
    # threads did it at once
    done = [build(modules[0])]
    with ThreadPoolExecutor(args.jobs) as pool:  # NVRTC releases the GIL
        done += list(pool.map(build, modules[1:]))
    for module, (path, seconds) in zip(modules, done):
        print(f"{module:12} {'cached' if seconds is None else f'{seconds:5.1f} s'}  {path.name}")
    print(f"{len(modules)} modules for sm_{args.arch} in {args.out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
