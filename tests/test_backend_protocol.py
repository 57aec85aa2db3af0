"""The backend protocol: every backend shipped declares its capabilities and has the methods they
name; backends are found by name; the engine uses only what a backend declares (a backend that
declares less gets the same tokens without the calls it did not declare)."""
from __future__ import annotations

import glob
import importlib
import inspect
import os
import subprocess
import sys

import pytest

from ember.backends import KV_TYPES, BackendError, Capabilities, available, get_backend
from ember.engine import Engine, EngineConfig, FinishEvent, Request, TokenEvent
from ember.gguf_loader import GGUFFile
from ember.models import load_model
from ember.quant import GGMLType
from ember.sampler import SamplingParams
from ember.tokenizer import Tokenizer
from synth import Shape, write_model

# capability -> the methods it comes with
METHODS = {"top_k": ["top_k"], "record": ["record", "replay"], "overlap": ["mark", "wait_mark"],
           "copy_pages": ["copy_pages"], "chain_tokens": ["get_rows"]}


@pytest.mark.parametrize("name", available())
def test_each_backend_declares_what_it_has(name):
    """Read from the class, without making one (the CUDA backend's module imports without CuPy)."""
    cls = importlib.import_module(f"ember.backends.{name}").Backend
    caps = cls.capabilities
    assert isinstance(caps, Capabilities)
    for capability, methods in METHODS.items():
        for method in methods:
            if getattr(caps, capability):
                assert callable(getattr(cls, method, None)), f"{name} declares {capability} without {method}()"
    if caps.chain_tokens:
        assert {"prev", "bans"} <= set(inspect.signature(cls.get_rows).parameters)
    if caps.overlap:
        assert "wait" in inspect.signature(cls.replay).parameters


def test_shipped_declarations():
    from ember.backends.cpu import Backend as Cpu
    from ember.backends.cuda import Backend as Cuda
    from ember.backends.reference import Backend as Reference
    from ember.backends.webgpu import Backend as WebGpu

    all_kv = frozenset(KV_TYPES.values())
    assert Cpu.capabilities == Capabilities(top_k=True, record=True, kv_types=all_kv, kv_head_parts=True)
    assert Reference.capabilities == Capabilities(top_k=True, kv_types=all_kv)
    assert WebGpu.capabilities == Capabilities(top_k=True, record=True, max_recorded_tokens=4096, overlap=True,
                                               chain_tokens=True, copy_pages=True)
    assert Cuda.capabilities == Capabilities(top_k=True, record=True, max_recorded_tokens=4096, overlap=True,
                                             chain_tokens=True, pad_decode_steps=True, copy_pages=True,
                                             kv_types=all_kv)


def test_inconsistent_declarations_are_refused():
    with pytest.raises(ValueError, match="overlap needs record"):
        Capabilities(overlap=True)
    with pytest.raises(ValueError, match="chain_tokens needs overlap and top_k"):
        Capabilities(record=True, overlap=True, chain_tokens=True)
    with pytest.raises(ValueError, match="max_recorded_tokens"):
        Capabilities(max_recorded_tokens=-1)


def test_backends_are_found_by_name():
    assert {"cpu", "cuda", "reference", "webgpu"} <= set(available()) and "base" not in available()
    assert get_backend("reference").name == "reference"
    for name in ("nope", "base", "../cpu", ""):
        with pytest.raises(BackendError, match=f"no backend named '{name}'"):
            get_backend(name)


@pytest.mark.skipif(not sys.platform.startswith("linux") or bool(glob.glob("/dev/dri/renderD*"))
                    or os.path.exists("/dev/nvidiactl"), reason="a Linux machine without GPU device files")
def test_auto_without_gpu_device_files_leaves_wgpu_unimported():
    """device="auto" on a machine without a GPU's device files picks the CPU without importing wgpu
    (whose import and adapter listing cost a start 0.3-0.9 s)."""
    code = ("import sys; from ember.backends import get_backend; "
            "b = get_backend('auto'); print(b.name, 'wgpu' in sys.modules, 'ember.backends.webgpu' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-3:] == ["cpu", "False", "False"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("proto") / "tiny.gguf", "llama", GGMLType.Q8_0, Shape(n_vocab=384),
                       vocab=True, tied=False)


def events(handles) -> list:
    return [[(ev.token if isinstance(ev, TokenEvent) else ev.reason) for ev in h
             if isinstance(ev, (TokenEvent, FinishEvent))] for h in handles]


def run_engine(path, backend, **config) -> tuple[list, Engine]:
    """Greedy and sampled requests, with and without bans, through an engine on `backend`."""
    with GGUFFile(path) as gguf:
        model = load_model(gguf, backend)
        engine = Engine(model, Tokenizer.from_metadata(gguf.metadata), EngineConfig(n_ctx=64, max_seqs=4, **config))
        try:
            greedy = [SamplingParams.greedy_params(), SamplingParams(temperature=0.0, ignore_eos=True)]
            out = events([engine.submit(Request([1, 5 + i, 9, 12 + i], 12, p)) for i, p in enumerate(greedy)])
            sampled = SamplingParams(temperature=0.9, seed=4, ignore_eos=True)
            out += events([engine.submit(Request([1, 7, 9], 12, sampled))])
        finally:
            engine.close()
        return out, engine


def test_the_engine_uses_only_what_a_backend_declares(tiny):
    """The CPU backend declaring nothing (a subclass whose top_k and record fail if called): the
    engine neither reduces rows on it nor records steps, and the tokens are those of the CPU
    backend declaring what it has, which did both."""
    from ember.backends.cpu import Backend as Cpu

    class Plain(Cpu):
        capabilities = Capabilities()

        def top_k(self, *args):
            raise AssertionError("top_k is not declared")

        def record(self):
            raise AssertionError("record is not declared")

    full, engine = run_engine(tiny, get_backend("cpu", threads=1), decode_ahead=True)
    assert engine.metrics.argmax_steps > 0 and engine.metrics.ahead_steps > 0 and engine.runner._recordings
    plain, engine = run_engine(tiny, Plain(threads=1), decode_ahead=True)
    assert engine.metrics.argmax_steps == engine.metrics.ahead_steps == 0 and not engine.runner._recordings
    assert plain == full and engine.last_error is None


def _fake_render_node(drm, name, driver, slot):
    """A sysfs render node as Linux shows it: device/driver links to the driver, device/uevent
    names the PCI slot."""
    device = drm / "devices" / slot
    device.mkdir(parents=True)
    drivers = drm / "drivers" / driver
    drivers.mkdir(parents=True, exist_ok=True)
    (device / "driver").symlink_to(drivers)
    (device / "uevent").write_text(f"DRIVER={driver}\nPCI_CLASS=30000\nPCI_SLOT_NAME={slot}\n")
    (drm / name).mkdir()
    (drm / name / "device").symlink_to(device)


@pytest.mark.parametrize("nodes, possible", [
    ([("i915", "0000:00:02.0")], False),                           # a laptop's Intel integrated GPU
    ([("virtio_gpu", "0000:00:01.0")], False),                      # a VM's virtual GPU
    ([("msm", "0000:00:00.0"), ("ast", "0000:02:00.0")], False),    # an Arm SoC's, a server's display chip
    ([("i915", "0000:00:02.0"), ("nvidia", "0000:01:00.0")], True),  # a laptop with an NVIDIA card
    ([("xe", "0000:03:00.0")], True),                               # an Intel Arc card
    ([("amdgpu", "0000:0c:00.0")], True),                           # AMD's: an APU or a card, wgpu tells
    ([], True),                                                     # sysfs says nothing: wgpu finds out
])
def test_auto_asks_wgpu_only_where_a_render_node_may_be_discrete(tmp_path, nodes, possible):
    from ember.backends import _render_nodes_discrete_possible

    for i, (driver, slot) in enumerate(nodes):
        _fake_render_node(tmp_path, f"renderD{128 + i}", driver, slot)
    assert _render_nodes_discrete_possible(str(tmp_path)) is possible
