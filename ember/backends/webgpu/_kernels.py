"""The WGSL modules and their compute pipelines on one device, compiled on first use and kept for the
process (every backend made on the same adapter shares them: a model's first step then waits for
no compiler when a second backend comes)."""
from __future__ import annotations

import threading
from importlib import resources


def source(name: str) -> str:
    return resources.files(__package__).joinpath("kernels", name).read_text()


# The checks naga compiles into every shader (wgpu-native's ShaderRuntimeChecks bits: 1 an index
# clamp on every array access, 2 a counter on every loop that ends it after 2^64 passes; None is
# wgpu's default, all of them). The kernels take none: each computes its indices within its
# bindings (rows past a matrix's end read its last row, token ids are checked against the
# vocabulary before a lookup), and on an H100 the checks cost the 8B a third of its prompt rate
# and a fifth of its decode rate (pp512 1096 -> 1835 tok/s, tg64 202 -> 251; bench/NOTES.md).
RUNTIME_CHECKS = 0


def create_module(device, code: str, checks: int | None):
    """A WGSL module with `checks` of naga's runtime checks (wgpuDeviceCreateShaderModuleTrusted), or
    wgpu's default ones where checks is None or this wgpu has no such call."""
    if checks is None:
        return device.create_shader_module(code=code)
    try:  # wgpu-py's own handles on wgpu-native (none of them public: any missing, the default call)
        from wgpu.backends.wgpu_native import _api
        from wgpu.backends.wgpu_native._ffi import ffi, lib
        make, source_type = lib.wgpuDeviceCreateShaderModuleTrusted, lib.WGPUSType_ShaderSourceWGSL
        new_struct, view, module_class, device_handle = (_api.new_struct_p, _api.to_c_string_view,
                                                         _api.GPUShaderModule, device._internal)
    except (ImportError, AttributeError):
        return device.create_shader_module(code=code)
    src = new_struct("WGPUShaderSourceWGSL *", code=view(code))
    src[0].chain.next = ffi.NULL
    src[0].chain.sType = source_type
    desc = new_struct("WGPUShaderModuleDescriptor *", nextInChain=ffi.cast("WGPUChainedStruct *", src), label=view(""))
    handle = make(device_handle, desc, checks)
    if handle == ffi.NULL:
        raise RuntimeError("WGSL module creation failed")
    return module_class("", handle, device)


class Kernels:
    def __init__(self, device):
        self.device = device
        self._modules: dict[str, object] = {}
        self._pipelines: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()

    def pipeline(self, module: str, entry: str):
        """Entry point `entry` of module "ops" or of a weight type's products (named by its decoder)."""
        key = (module, entry)
        pipe = self._pipelines.get(key)
        if pipe is None:
            with self._lock:
                pipe = self._pipelines.get(key) or self.device.create_compute_pipeline(
                    layout="auto", compute={"module": self._module(module), "entry_point": entry})
                self._pipelines[key] = pipe
        return pipe

    def _module(self, name: str):
        mod = self._modules.get(name)
        if mod is None:
            if name == "ops":
                code = source("common.wgsl") + source("ops.wgsl")
            elif name.startswith("ops+fl"):  # ops with the prompt attention tiles, FL_VC vec4s of values a row
                code = (f"const FL_VC: u32 = {int(name.removeprefix('ops+fl'))}u;\n" + source("common.wgsl")
                        + source("ops.wgsl") + source("attn_flash.wgsl"))
            else:
                code = _products(*name.split("+"))
            mod = self._modules[name] = create_module(self.device, code, RUNTIME_CHECKS)
        return mod

    def names(self) -> dict[int, tuple[str, str]]:
        """(module, entry) of each pipeline by its id (for profiles)."""
        return {id(p): key for key, p in self._pipelines.items()}


# types with a decode entry of their own (mvk: a lane's item 32 weights, each word read once) beside
# mvp: its file and the binding of the weights (Q4_K's 7: the same buffer read as 16-byte words)
MV_OWN = {"deq_q4_k": ("matvec_q4k.wgsl", 7), "deq_q6_k": ("matvec_q6k.wgsl", 1)}
# the 32-value block types, whose int8 decode products (mvq) are mvp's pieces as integers
MV_INT = ("deq_q4_0", "deq_q4_1", "deq_q5_0", "deq_q5_1", "deq_q8_0")
# the types whose 32-value runs have a scale and an offset for each half (mmq sums the halves apart)
RUN_HALVES = ("deq_q6_k",)
# the types whose prompt tiles have an int8 entry (mmq, matmul_q8.wgsl: a run reader each)
MM_INT = MV_INT + ("deq_q4_k", "deq_q5_k", "deq_q6_k")

# the lanes' sum of the matrix-vector kernel: (entry point's extra builtins, call)
MV_SUMS = {"sg": (", @builtin(subgroup_size) sg_size: u32, @builtin(subgroup_invocation_id) sg_lane: u32",
                  "mv_sum(acc, tw, sg_size, sg_lane, g, rows, n);"),
           "wg": ("", "mv_sum(acc, tw, g, rows, n);")}


def mv_build(lanes: int = 32, teams: int = 1, rows: int = 2) -> str:
    """The decode kernel's build suffix (_products' "+w", "+r" and "+t" parts) of teams of `lanes`
    lanes, `teams` a workgroup, `rows` weight rows a team; "" for the defaults."""
    return ((f"+w{lanes}" if lanes != 32 else "") + (f"+r{rows}" if rows != 2 else "")
            + (f"+t{teams}" if teams > 1 else ""))


KV_BUILD = "+kv"  # a decode build's suffix for the products that rope and store (matvec_kv.wgsl)


def _products(decoder: str, *variant: str) -> str:
    """A weight type's products module (its decoder, dequant.wgsl, named DEQ; its piece reader,
    pieces.wgsl, named PIECE): the prompt tiles, row lookups and the CPU adapters' matrix-vector
    kernel (matmul.wgsl); with a variant ("mv1+sg": NX activation rows, lanes summed by subgroups
    or "wg" workgroup memory; "mv1+sg+w128": teams of 128 lanes, 32 unless named; "+t4": 4 teams
    a workgroup, each on rows of its own, 1 unless named) the decode kernel too (matvec.wgsl);
    "+r4" builds it for 4 weight rows a team (the lane benchmark's variant, not gated products); "+kv"
    with the queries' and keys' rope and the keys' and values' cache stores in its store."""
    code = source("common.wgsl") + source("dequant.wgsl") + source("pieces.wgsl") + source("matmul.wgsl")
    if variant == ("mmq",):  # the prompt tiles on int8 x (IRUN: the type's run reader)
        code = f"const RUN_HALVES = {str(decoder in RUN_HALVES).lower()};\n" + code + source("matmul_q8.wgsl")
    elif variant:
        rows, how, *lanes = variant
        args, call = MV_SUMS[how]
        mv = source("matvec.wgsl")
        if decoder in MV_OWN:  # its own decode entries (mvk, mvq) beside mvp
            mv += source(MV_OWN[decoder][0])
        elif decoder in MV_INT:  # mvp's pieces on int8 x (mvq)
            mv += source("matvec_q8.wgsl")
        wide, teams = 32, 1
        for part in lanes:
            if part.startswith("w"):  # "w64": teams of 64 lanes (32 unless named)
                wide = int(part.removeprefix("w"))
                mv = mv.replace("const MV_WG: u32 = 32u;", f"const MV_WG: u32 = {wide}u;")
            elif part.startswith("t"):  # "t4": 4 teams a workgroup, each on its own rows (1 unless named)
                teams = int(part.removeprefix("t"))
                mv = mv.replace("const MV_TEAMS: u32 = 1u;", f"const MV_TEAMS: u32 = {teams}u;")
            elif part.startswith("r"):  # "r4": 4 weight rows a workgroup (2 unless named; not gated)
                mv = mv.replace("const NR: u32 = 2u;", f"const NR: u32 = {int(part.removeprefix('r'))}u;")
            elif part == KV_BUILD[1:]:  # rope and the cache stores in the store (2 rows a team only)
                mv = mv.replace("fn mv_store(", "fn mv_store_plain(") + source("matvec_kv.wgsl")
        mv = mv.replace("@workgroup_size(32)", f"@workgroup_size({wide * teams})")
        code = f"const NX: u32 = {int(rows.removeprefix('mv'))}u;\n" + code + mv + source(f"matvec_{how}.wgsl")
        code = code.replace(" MV_SUM_ARGS", args).replace("MV_SUM_CALL", call)
    code = code.replace("IRUN(", decoder.replace("deq_", "ir_") + "(")
    code = code.replace("IPIECE(", decoder.replace("deq_", "ip_") + "(")
    code = code.replace("PIECE(", decoder.replace("deq_", "pc_") + "(")
    return code.replace("DEQ(", f"{decoder}(")  # naga takes subgroup builtins without `enable`
