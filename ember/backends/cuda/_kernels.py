"""Run-time compilation of the CUDA C kernels (package data under kernels/), cached on disk.

A module is compiled once per source text, compiler and GPU architecture: NVRTC turns it into
a cubin stored under ~/.cache/ember/kernels (EMBER_KERNEL_CACHE overrides), and later starts
load that file. Compiles run in a thread pool (NVRTC releases the GIL), so a model's modules
build in parallel while its weights upload. Under ROCm, CuPy's own compile path (hipRTC) and
cache are used instead.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ...quant import grids
from ..base import BackendError

CACHE_VERSION = "2"  # bump when the way sources are assembled changes
ATT_TILE_DIMS = (64, 128, 256)  # head sizes of attn_tile (attention.cu), a module each
WIDE_CLUSTERS = {"attn_cluster16"}  # kernels of clusters wider than 8 blocks (Hopper allows 16)
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CUfunction_attribute


def cache_dir() -> Path:
    return Path(os.environ.get("EMBER_KERNEL_CACHE") or Path.home() / ".cache" / "ember" / "kernels")


def kernel_source(name: str) -> str:
    return resources.files(__package__).joinpath("kernels", name).read_text()


def low_bit_source() -> str:
    """quant_iq.cuh with the i-quant grids' code tables (ember/quant/grids.py) in place."""
    return kernel_source("quant_iq.cuh").replace("// @grid tables@\n", grids.c_arrays("IQ_TABLE u16"), 1)


MATMUL_VARIANTS = {"": "", "batch": "#define MV_BATCH 1\n", "occ": "#define MV_OCC 1\n",
                   "store": "#define MV_STORE 1\n", "xs": "#define MV_XS 1\n"}


def module_source(module: str) -> str:
    """The full source of one compiled module: "ops", "kv_quant" (the KV cache in BF16, Q8_0, Q4_0), "attention" (decode attention and the split
    merges), "attention_tile<64|128|256>" (one head size's tensor-core attention), "sample",
    "matmul_<ggml type id>", "matmul_<ggml type id>_batch" (the matrix-vector kernels of 2 to 8
    rows), "matmul_<ggml type id>_occ" (mv_n1_occ), "matmul_<ggml type id>_store" (mv_n1_store) or
    "matmul_<ggml type id>_xs" (mv_xs: Q8_0, Q4_K and Q5_K only), see matmul.cu; "experts_<ggml type id>" (grouped expert products, experts.cu)."""
    common = kernel_source("common.cuh")
    if module in ("ops", "sample", "kv_quant"):
        return common + kernel_source(f"{module}.cu")
    if module == "attention" or module in tuple(f"attention_tile{hd}" for hd in ATT_TILE_DIMS):
        hd = int(module[len("attention_tile"):]) if module != "attention" else 0
        return f"#define ATT_TILE_HD {hd}\n" + common + kernel_source("attention.cu")
    parts = module.split("_")
    if parts[0] == "experts" and len(parts) == 2 and parts[1].isdigit():
        return f"#define QT {int(parts[1])}\n" + common + kernel_source("quant.cuh") + low_bit_source() \
            + kernel_source("experts.cu")
    variant = parts[2] if len(parts) == 3 else ""
    if parts[0] == "matmul" and len(parts) in (2, 3) and parts[1].isdigit() and variant in MATMUL_VARIANTS:
        defines = f"#define QT {int(parts[1])}\n" + MATMUL_VARIANTS[variant]
        return defines + common + kernel_source("quant.cuh") + low_bit_source() + kernel_source("matmul.cu")
    raise BackendError(f"no kernel module named '{module}'")


def matmul_module(qtype: int, kernel: str = "") -> str:
    """The module holding one of matmul.cu's kernels for a weight type."""
    variant = {"mv_n2": "batch", "mv_n4": "batch", "mv_n8": "batch", "mv_n1_occ": "occ",
               "mv_n1_store": "store", "mv_xs": "xs"}.get(kernel)
    return f"matmul_{int(qtype)}_{variant}" if variant else f"matmul_{int(qtype)}"


@dataclass
class CompileStats:
    compiled: list = field(default_factory=list)  # (module, seconds)
    loaded_from_cache: list = field(default_factory=list)


class Kernels:
    """Compiled modules of one device, and their functions by name."""

    def __init__(self, cp, device):
        self.cp = cp
        self.hip = bool(getattr(cp.cuda.runtime, "is_hip", False))
        self.arch = nvrtc_arch(device.compute_capability) if not self.hip else device.compute_capability
        # dynamic shared memory a kernel may ask for, less room for its static shared arrays
        self.max_smem = int(device.attributes.get("MaxSharedMemoryPerBlockOptin", 48 * 1024)) - 2048
        self.stats = CompileStats()
        self._pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="ember-nvrtc")
        self._futures: dict[str, Future] = {}
        self._later: list[str] = []  # see prefetch_later
        self._modules: dict = {}
        self._functions: dict = {}
        self._names: dict = {}  # id(function) -> "module.name", for profiles
        self._lock = threading.Lock()

    def prefetch(self, module: str) -> None:
        """Start compiling (or loading) a module in the background."""
        with self._lock:
            if module not in self._futures:
                self._futures[module] = self._pool.submit(self._build, module)

    def prefetch_later(self, module: str) -> None:
        """Compile (or load) a module in the background, but only once a module is first needed
        and after every module asked for before then: a model's kernels for batched decode, which
        its first token does not wait for (on a machine of few cores they would slow those it does)."""
        with self._lock:
            if module not in self._futures and module not in self._later:
                self._later.append(module)

    def _submit_later(self) -> None:
        with self._lock:
            later, self._later = self._later, []
            before = list(self._futures.values())
            for module in later:
                if module not in self._futures:
                    # the pool takes tasks in order: those waited on were taken before this one
                    self._futures[module] = self._pool.submit(self._build_after, module, before)

    def _build_after(self, module: str, before: list):
        for f in before:
            f.exception()  # waits; a failed module reports its error where it is used
        return self._build(module)

    def module(self, module: str):
        if self._later:
            with self._lock:
                if module in self._later:  # needed now: no longer later
                    self._later.remove(module)
        self.prefetch(module)  # ahead of the later ones
        if self._later:
            self._submit_later()
        mod = self._modules.get(module)
        if mod is None:
            binary = self._futures[module].result()  # raises the compile error, if any
            mod = self._load(module, binary)
            self._modules[module] = mod
        return mod

    def fn(self, module: str, name: str):
        key = (module, name)
        f = self._functions.get(key)
        if f is None:
            f = self.module(module).get_function(name)
            if name in WIDE_CLUSTERS:  # past the portable 8 blocks a cluster: allowed per function
                from cupy.cuda import driver
                driver.funcSetAttribute(f.kernel.ptr, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            self._functions[key] = f
            self._names[id(f)] = f"{module}.{name}"
        return f

    def name_of(self, f) -> str:
        return self._names.get(id(f), "?")

    # ---- building ----
    def _build(self, module: str):
        """Path of the module's cubin (CUDA) or its source (HIP: CuPy compiles and caches it)."""
        if self.hip:
            return module_source(module)
        path, seconds = build_cubin(module, self.arch)
        if seconds is None:
            self.stats.loaded_from_cache.append(module)
        else:
            self.stats.compiled.append((module, seconds))
        return path

    def _load(self, module: str, binary):
        if self.hip:
            return self.cp.RawModule(code=binary, options=("-std=c++17",))
        return self.cp.RawModule(path=str(binary))


def build_cubin(module: str, arch: str, cache: Path | None = None) -> tuple[Path, float | None]:
    """The module's cubin for sm_<arch> in the cache (compiled there unless it already is): its
    path, and the seconds compiling took (None: it was there). Needs NVRTC, not a GPU, so a cache
    can be filled ahead on another machine and carried (bench/cuda_kernel_cache.py)."""
    from cupy.cuda import nvrtc

    src, opts = module_source(module), ("-std=c++17", f"-arch=sm_{arch}")
    key = hashlib.sha256("\0".join([CACHE_VERSION, src, *opts, str(nvrtc.getVersion())]).encode()).hexdigest()
    path = (cache or cache_dir()) / f"{module}-{key[:24]}.cubin"
    if path.exists():
        return path, None
    t0 = time.perf_counter()
    cubin = compile_nvrtc(src, f"{module}.cu", opts)
    seconds = time.perf_counter() - t0
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
    tmp.write_bytes(cubin)
    os.replace(tmp, path)  # atomic: a concurrent start sees the whole file or none
    return path, seconds


def nvrtc_arch(compute_capability: str) -> str:
    """The device's architecture, or the newest older one this NVRTC can target."""
    from cupy.cuda import nvrtc

    want = int(compute_capability)
    try:
        supported = [int(a) for a in nvrtc.getSupportedArchs()]
    except Exception:  # an NVRTC without the query: assume it knows the device
        return str(want)
    return str(max((a for a in supported if a <= want), default=want))


def compile_nvrtc(src: str, name: str, options) -> bytes:
    """CUDA C -> cubin with NVRTC; a compile error becomes a BackendError carrying the log."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(src, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise BackendError(f"compiling the CUDA kernels of {name} failed ({e}):\n{log[-4000:]}") from None
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
