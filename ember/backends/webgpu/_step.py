"""A step of ops as the device runs it: the dispatches, the host ints they read, the arrays brought
back. Ops are collected, never run one by one: a step is encoded into one command buffer when its
results are asked for (eager) or when a recording ends, and a recording is encoded again on
each replay from the bind groups it made once (WebGPU command buffers run once)."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import numpy as np

PARAM_SLOT = 256  # bytes of one dispatch's parameters in the step's uniform buffer (offset alignment)
PARAM_WORDS = 32  # of which the kernels read this many 4-byte words


@dataclass(slots=True)
class GpuArray:
    """A device buffer viewed as a C-ordered array (rows may be sliced off its end)."""

    buf: object  # wgpu.GPUBuffer
    shape: tuple
    dtype: np.dtype
    offset: int = 0  # elements before the view's first

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("device arrays take row slices only")
        lo, hi, _ = key.indices(self.shape[0])
        hi = max(lo, hi)
        row = int(np.prod(self.shape[1:], dtype=np.int64))
        return GpuArray(self.buf, (hi - lo, *self.shape[1:]), self.dtype, self.offset + lo * row)

    def reshape(self, *shape):
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        if -1 in shape:
            known = int(np.prod([s for s in shape if s != -1], dtype=np.int64))
            shape = tuple(self.size // max(known, 1) if s == -1 else s for s in shape)
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            raise ValueError(f"cannot reshape {self.shape} to {shape}")
        return GpuArray(self.buf, shape, self.dtype, self.offset)


INPUTS = object()  # a binding of the step's host-ints buffer


@functools.cache
def native_encoder():
    """(encode, address of) where a replayed step's dispatches can be encoded through wgpu-native's
    own set_pipeline, set_bind_group and dispatch_workgroups on the step's handles (wgpu-py's
    methods check and convert their arguments on every call, most of a step's host time then):
    in one call of csrc/encode.c, or where that extension is not built, a Python loop over the raw
    functions. None where this wgpu does not lay its binding out so (wgpu-py's methods then)."""
    try:
        from wgpu.backends.wgpu_native._api import ffi, lib

        names = tuple(f"wgpuComputePassEncoder{op}" for op in ("SetPipeline", "SetBindGroup", "DispatchWorkgroups"))
        fns = tuple(getattr(lib, name) for name in names)
    except (ImportError, AttributeError):
        return None

    def address(cdata) -> int:
        return int(ffi.cast("uintptr_t", cdata))

    try:
        from ._ember_webgpu import lib as native
    except ImportError:
        return _python_encoder(fns, ffi.NULL), address
    addresses = tuple(address(ffi.addressof(lib, name)) for name in names)

    def encode(cpass, handles) -> None:
        pipelines, groups, sizes, _ = handles
        native.encode_dispatches(address(cpass._internal), *addresses, ffi.from_buffer("uint64_t[]", pipelines),
                                 ffi.from_buffer("uint64_t[]", groups), ffi.from_buffer("uint32_t[]", sizes),
                                 len(pipelines))

    return encode, address


class NativeQueue:
    """Submits and readbacks through wgpu-native's own functions: a submission's index, the
    readback's map asked for at once, and a wait for exactly that submission. wgpu-py's maps are
    completed by its poll thread, whose blocking poll holds the device's fence for the queue's last
    submission at the time it polls: a submit meanwhile (the next step's, queued while this one
    runs) would stall until that work is done. Here nothing polls but the host's wait."""

    MAX_POLLS = 1000  # blocking polls before a map that never completes is an error (each waits)

    def __init__(self, ffi, lib):
        self.ffi, self.lib = ffi, lib
        # maps asked for, kept (their callbacks with them) until their callbacks have run: a step
        # dropped unread (an evicted recording) still has its callback fire at some later poll
        self._asked: dict = {}
        self._answered: list = []
        self._freed: list = []

    def submit(self, device, command_buffer) -> int:
        buffers = self.ffi.new("WGPUCommandBuffer[]", [command_buffer._internal])
        return int(self.lib.wgpuQueueSubmitForIndex(device.queue._internal, 1, buffers))

    def map_read(self, buffer, index: int):
        """The map of buffer (whole) for reading, asked for now; complete it with `read`."""
        ffi, lib = self.ffi, self.lib
        # callbacks that have run are freed a map later, well outside any callback (one may run on
        # wgpu-py's poll thread)
        self._freed, self._answered = self._answered, []
        state = {"status": None, "index": index, "buffer": buffer}

        @ffi.callback("void(WGPUMapAsyncStatus, WGPUStringView, void *, void *)")
        def done(status, message, _a, _b):
            state["status"] = int(status)
            self._answered.append(self._asked.pop(id(state), None))

        info = ffi.new("WGPUBufferMapCallbackInfo *")
        info.mode = lib.WGPUCallbackMode_AllowProcessEvents
        info.callback = done
        self._asked[id(state)] = (state, done, info)
        lib.wgpuBufferMapAsync(buffer._internal, lib.WGPUMapMode_Read, 0, buffer.size, info[0])
        return state

    def read(self, device, state, into) -> None:
        """Wait for the map's submission, pass the mapped bytes to into(bytes view), unmap."""
        ffi, lib = self.ffi, self.lib
        index = ffi.new("WGPUSubmissionIndex *", state["index"])
        for _ in range(self.MAX_POLLS):
            if state["status"] is not None:
                break
            lib.wgpuDevicePoll(device._internal, True, index)
        if state["status"] != lib.WGPUMapAsyncStatus_Success:
            raise RuntimeError(f"the WebGPU readback could not be mapped (status {state['status']})")
        buffer = state["buffer"]
        try:
            ptr = lib.wgpuBufferGetConstMappedRange(buffer._internal, 0, buffer.size)
            into(np.frombuffer(ffi.buffer(ffi.cast("const char *", ptr), buffer.size), np.uint8))
        finally:
            lib.wgpuBufferUnmap(buffer._internal)


@functools.cache
def native_queue() -> NativeQueue | None:
    """NativeQueue where this wgpu exposes the functions it calls, else None (wgpu-py's submit and
    map then)."""
    try:
        from wgpu.backends.wgpu_native._api import ffi, lib

        for name in ("wgpuQueueSubmitForIndex", "wgpuDevicePoll", "wgpuBufferMapAsync", "wgpuBufferGetConstMappedRange",
                     "wgpuBufferUnmap", "WGPUMapAsyncStatus_Success", "WGPUCallbackMode_AllowProcessEvents",
                     "WGPUMapMode_Read"):
            getattr(lib, name)
    except (ImportError, AttributeError):
        return None
    return NativeQueue(ffi, lib)


def _python_encoder(fns, null):
    set_pipeline, set_bind_group, dispatch = fns

    def encode(cpass, handles) -> None:
        h, current = cpass._internal, None
        for pipeline, bg, x, y, z in handles[3]:
            if pipeline != current:
                set_pipeline(h, pipeline)
                current = pipeline
            set_bind_group(h, 0, bg, 0, null)
            dispatch(h, x, y, z)

    return encode


@dataclass(slots=True)
class Dispatch:
    pipeline: object
    bindings: tuple  # (binding, GPUBuffer or INPUTS), binding 0 (the params) apart
    params: np.ndarray  # PARAM_WORDS u32
    groups: tuple[int, int, int]


@dataclass
class Step:
    """What a step's ops asked for, then the device objects that run it."""

    record: bool  # host ints read again at each run (else copied when the op was called)
    dispatches: list = field(default_factory=list)
    inputs: list = field(default_factory=list)  # (host int array, word offset)
    input_keys: dict = field(default_factory=dict)  # (address, shape, dtype) -> input index
    n_words: int = 0
    downloads: list = field(default_factory=list)  # (GpuArray, host array it fills)
    # made by build()
    bind_groups: list | None = None
    arena: object = None
    readback: object = None
    host_ints: np.ndarray | None = None
    # wgpu-native's pipelines, bind groups and workgroup counts as arrays and as tuples (native_encoder)
    handles: tuple | None = None
    encode_s: float = 0.0  # host time of the last run's encoding, and its wait for the device
    wait_s: float = 0.0
    mapping: object = None  # the readback's map while a run's downloads are still to be read (finish)
    submitted_at: float = 0.0

    def add_input(self, a: np.ndarray) -> int:
        """Word offset of host ints a (int32 on the device) in the step's inputs buffer."""
        key = (a.__array_interface__["data"][0], a.shape, a.dtype.str)
        at = self.input_keys.get(key)
        if at is not None and (self.record or np.array_equal(self.inputs[at][0], a)):
            return self.inputs[at][1]
        return self._place(key, a if self.record else np.array(a, np.int32), a.size)

    def add_derived(self, key: tuple, fill) -> int:
        """Word offset of host ints that fill() computes from the step's other inputs (their arrays
        as the ops saw them): a recorded step calls fill again on each run, after the runner has
        written its new inputs; key names the computation for the step's other ops."""
        at = self.input_keys.get(key)
        if at is not None:
            return self.inputs[at][1]
        a = np.asarray(fill(), np.int32)
        return self._place(key, fill if self.record else a, a.size)

    def _place(self, key, held, size: int) -> int:
        """An input (an array, or a function giving one) placed after the others: its word offset."""
        self.input_keys[key] = len(self.inputs)
        self.inputs.append((held, self.n_words))
        self.n_words += -(-max(size, 1) // 4) * 4  # 16-byte steps
        return self.inputs[-1][1]

    def build(self, device, wgpu) -> None:
        """The step's buffers and bind groups, made once."""
        usage = wgpu.BufferUsage
        self.arena = device.create_buffer(size=max(16, self.n_words * 4), usage=usage.STORAGE | usage.COPY_DST)
        self.host_ints = np.zeros(max(4, self.n_words), np.int32)
        params = np.zeros((max(1, len(self.dispatches)), PARAM_SLOT // 4), np.uint32)
        for i, d in enumerate(self.dispatches):
            params[i, :PARAM_WORDS] = d.params
        uniforms = device.create_buffer_with_data(data=params.tobytes(), usage=usage.UNIFORM)
        self.bind_groups = [self._bind_group(device, d, uniforms, i * PARAM_SLOT)
                            for i, d in enumerate(self.dispatches)]
        native = native_encoder()
        if native is not None:
            address = native[1]
            self.handles = (np.array([address(d.pipeline._internal) for d in self.dispatches], np.uint64),
                            np.array([address(bg._internal) for bg in self.bind_groups], np.uint64),
                            np.array([d.groups for d in self.dispatches], np.uint32).reshape(-1),
                            [(d.pipeline._internal, bg._internal, *d.groups)
                             for d, bg in zip(self.dispatches, self.bind_groups)])
        size = sum(_padded(a.nbytes) for a, _ in self.downloads)
        if size:
            self.readback = device.create_buffer(size=size, usage=usage.MAP_READ | usage.COPY_DST)

    def _bind_group(self, device, d: Dispatch, uniforms, offset: int):
        entries = [{"binding": 0, "resource": {"buffer": uniforms, "offset": offset, "size": PARAM_WORDS * 4}}]
        entries += [{"binding": b, "resource": {"buffer": self.arena if buf is INPUTS else buf, "offset": 0,
                                                 "size": (self.arena if buf is INPUTS else buf).size}}
                    for b, buf in d.bindings]
        return device.create_bind_group(layout=d.pipeline.get_bind_group_layout(0), entries=entries)

    def run(self, device, wgpu, wait: bool = True) -> None:
        """Inputs written, the step encoded as one command buffer and submitted; the downloads filled
        (wait=False: by finish(), the host meanwhile free to queue the next step)."""
        self.finish()  # a run before still unread: its readback is taken again
        t0 = time.perf_counter()
        if self.inputs:
            for a, at in self.inputs:
                flat = (a() if callable(a) else a).reshape(-1)
                self.host_ints[at:at + flat.size] = flat
            device.queue.write_buffer(self.arena, 0, self.host_ints)
        encoder = device.create_command_encoder()
        if self.dispatches:
            cpass = encoder.begin_compute_pass()
            self._encode(cpass)
            cpass.end()
        at = 0
        for a, _ in self.downloads:
            size = _padded(a.nbytes)
            encoder.copy_buffer_to_buffer(a.buf, a.offset * np.dtype(a.dtype).itemsize, self.readback, at, size)
            at += size
        queue = native_queue() if self.readback is not None else None
        if queue is not None:
            index = queue.submit(device, encoder.finish())
        else:
            device.queue.submit([encoder.finish()])
        self.submitted_at = time.perf_counter()
        self.encode_s, self.wait_s = self.submitted_at - t0, 0.0
        if self.readback is None:  # nothing to wait for: later work is queued behind it
            return
        # the map asked for now, completed by finish(): the host may queue more meanwhile
        if queue is not None:
            self.mapping = (queue, device, queue.map_read(self.readback, index))
        else:  # the map waits for wgpu-py's poll thread (no empty submit first: READ_NOSYNC)
            self.mapping = (None, device, self.readback.map_async("READ_NOSYNC"))
        if wait:
            self.finish()

    def finish(self) -> None:
        """Until the last run's work is done, its downloads filled (nothing where they are)."""
        mapping, self.mapping = self.mapping, None
        if mapping is None:
            return
        queue, device, state = mapping
        if queue is not None:
            queue.read(device, state, self._fill)
        else:
            state.sync_wait()
            try:
                self._fill(np.frombuffer(self.readback.read_mapped(copy=False), np.uint8))
            finally:
                self.readback.unmap()
        self.wait_s = time.perf_counter() - self.submitted_at

    def _fill(self, raw: np.ndarray) -> None:
        """The downloads from the readback's bytes."""
        at = 0
        for a, host in self.downloads:
            host.reshape(-1).view(np.uint8)[...] = raw[at:at + a.nbytes]
            at += _padded(a.nbytes)

    def _encode(self, cpass) -> None:
        """The dispatches into a compute pass (a pipeline set only where it changes)."""
        native = native_encoder()
        if native is not None and self.handles is not None:
            native[0](cpass, self.handles)  # the step holds the objects these handles are of
            return
        current = None
        for d, bg in zip(self.dispatches, self.bind_groups):
            if d.pipeline is not current:
                cpass.set_pipeline(d.pipeline)
                current = d.pipeline
            cpass.set_bind_group(0, bg)
            cpass.dispatch_workgroups(*d.groups)

    def gpu_times(self, device, wgpu) -> np.ndarray:
        """Nanoseconds each dispatch takes on the adapter (a compute pass each, timestamps at its
        ends; needs the device's timestamp-query feature). Inputs as the last run left them."""
        n = len(self.dispatches)
        queries = device.create_query_set(type="timestamp", count=2 * n)
        usage = wgpu.BufferUsage
        resolved = device.create_buffer(size=16 * n, usage=usage.QUERY_RESOLVE | usage.COPY_SRC)
        encoder = device.create_command_encoder()
        for i, (d, bg) in enumerate(zip(self.dispatches, self.bind_groups)):
            cpass = encoder.begin_compute_pass(timestamp_writes={
                "query_set": queries, "beginning_of_pass_write_index": 2 * i, "end_of_pass_write_index": 2 * i + 1})
            cpass.set_pipeline(d.pipeline)
            cpass.set_bind_group(0, bg)
            cpass.dispatch_workgroups(*d.groups)
            cpass.end()
        encoder.resolve_query_set(queries, 0, 2 * n, resolved, 0)
        device.queue.submit([encoder.finish()])
        stamps = np.frombuffer(device.queue.read_buffer(resolved), np.uint64).reshape(n, 2).astype(np.int64)
        return stamps[:, 1] - stamps[:, 0]  # wgpu converts ticks to nanoseconds

    def gpu_time(self, device, wgpu) -> float:
        """Seconds the adapter takes for the whole step as replays run it (one compute pass, a
        timestamp at each end; needs the device's timestamp-query feature). Inputs as the last run
        left them; nothing is read back."""
        queries = device.create_query_set(type="timestamp", count=2)
        usage = wgpu.BufferUsage
        resolved = device.create_buffer(size=16, usage=usage.QUERY_RESOLVE | usage.COPY_SRC)
        encoder = device.create_command_encoder()
        cpass = encoder.begin_compute_pass(timestamp_writes={
            "query_set": queries, "beginning_of_pass_write_index": 0, "end_of_pass_write_index": 1})
        self._encode(cpass)
        cpass.end()
        encoder.resolve_query_set(queries, 0, 2, resolved, 0)
        device.queue.submit([encoder.finish()])
        stamps = np.frombuffer(device.queue.read_buffer(resolved), np.uint64).astype(np.int64)
        return 1e-9 * float(stamps[1] - stamps[0])  # wgpu converts ticks to nanoseconds


def _padded(nbytes: int) -> int:
    return max(4, -(-nbytes // 4) * 4)
