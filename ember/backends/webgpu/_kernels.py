"""The WGSL modules and their compute pipelines on one device, compiled on first use and kept for the
process (every backend made on the same adapter shares them: a model's first step then waits for
no compiler when a second backend comes)."""
from __future__ import annotations

import threading
from importlib import resources


def source(name: str) -> str:
    return resources.files(__package__).joinpath("kernels", name).read_text()


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
            else:  # a weight type's products: its decoder (dequant.wgsl) named DEQ; "+sg": with subgroups
                decoder, _, subgroups = name.partition("+")
                code = source("common.wgsl") + source("dequant.wgsl") + source("matmul.wgsl")
                if subgroups:
                    code += source("matmul_sg.wgsl")  # naga takes subgroup builtins without `enable`
                code = code.replace("DEQ(", f"{decoder}(")
            mod = self._modules[name] = self.device.create_shader_module(code=code)
        return mod

    def names(self) -> dict[int, tuple[str, str]]:
        """(module, entry) of each pipeline by its id (for profiles)."""
        return {id(p): key for key, p in self._pipelines.items()}
