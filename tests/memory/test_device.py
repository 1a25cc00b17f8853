"""The device layer (memory/device.py): each backend's calls, on the CPU with torch's device functions replaced.

No accelerator here: CUDA's and XPU's allocator statistics, MPS's memory figures and a new device type's module
are counters standing in for torch's functions, so the layer's own code runs as it would on those devices.
"""

import re
import types
from pathlib import Path

import pytest
import torch

from dynabatch.compat.bionemo import collect_cuda_peak_alloc
from dynabatch.memory import device
from dynabatch.memory.device import (
    AllocatorBackend,
    backend_of,
    default_accelerator,
    device_in_use,
    free_bytes,
    free_memory,
    is_out_of_memory_error,
    knows_memory,
    register_backend,
    simulated_memory,
    total_bytes,
)
from dynabatch.memory.measure import check_device, check_measurable_device, track_peak_memory


class _FakeAllocator:
    """A torch device module's allocator statistics over a counter (``torch.cuda``'s functions, by name)."""

    def __init__(self, held=1000, free=8000, total=16000, reserved=1500, initialized=True):
        self.allocated = self.peak = held
        self.free, self.total, self.reserved = free, total, reserved
        self.emptied = 0
        self.initialized = initialized
        self.fractions = []

    def functions(self):
        return {
            "is_available": lambda: True, "is_initialized": lambda: self.initialized, "device_count": lambda: 1,
            "current_device": lambda: 0, "synchronize": self.synchronize,
            "reset_peak_memory_stats": self.reset, "memory_allocated": lambda device=None: self.allocated,
            "max_memory_allocated": lambda device=None: self.peak, "memory_reserved": lambda device=None: self.reserved,
            "mem_get_info": lambda device=None: (self.free, self.total), "empty_cache": self.empty,
            "set_per_process_memory_fraction": self.set_fraction,
        }

    def install(self, monkeypatch, module):
        for name, fn in self.functions().items():
            monkeypatch.setattr(module, name, fn, raising=False)
        return self

    def synchronize(self, device=None):
        self.initialized = True  # as torch.cuda's calls set the allocator up on first use

    def reset(self, device=None):
        if not self.initialized:  # what torch.cuda.reset_peak_memory_stats raises before any CUDA call
            raise RuntimeError("Invalid device argument 0: did you call init?")
        self.peak = self.allocated

    def empty(self):
        self.emptied += 1

    def set_fraction(self, fraction, device=None):
        # torch's own check (torch.cuda._utils._get_device_index with optional=False)
        if isinstance(device, torch.device) and device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        self.fractions.append((fraction, device))

    def alloc(self, n):
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def release(self, n):
        self.allocated -= n


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_allocator_backends_answer_through_torchs_statistics(monkeypatch, kind):
    fake = _FakeAllocator(held=1000).install(monkeypatch, getattr(torch, kind))
    with track_peak_memory(kind) as mem:  # what was held before (weights) is never counted
        fake.alloc(500)
        mem.mark()
        fake.alloc(300)
        fake.release(300)
        fake.release(400)
    assert mem.device == torch.device(kind, 0) and mem.segment_peaks == [500, 800] and mem.peak_bytes == 800
    assert free_bytes(kind) == 8000 + 1500 - 1100  # free, plus cached blocks the allocator holds unused
    assert total_bytes(f"{kind}:0") == 16000
    assert device_in_use() == torch.device(kind, 0) and backend_of(kind).count() == 1
    free_memory()
    assert fake.emptied == 1
    assert check_measurable_device("device", kind) == torch.device(kind, 0)
    with pytest.raises(ValueError, match=rf"device should be an available device \(this machine has 1 "
                                         rf"{kind.upper()} device\(s\), {kind}:0 to {kind}:0\), but got device='{kind}:2'"):
        check_device("device", f"{kind}:2")
    with pytest.raises(ValueError, match=rf"limit_bytes should be None on a {kind.upper()} device"):
        with track_peak_memory(kind, limit_bytes=10):
            pass


def test_capped_resolves_a_bare_cuda_to_the_current_device(monkeypatch):
    # torch's set_per_process_memory_fraction refuses torch.device("cuda") without an index (the training
    # benchmark's probe table crashed on an H200 with this): the device layer passes the current device's index.
    fake = _FakeAllocator(total=16000).install(monkeypatch, torch.cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    with backend_of("cuda").capped(torch.device("cuda"), 4000):
        assert fake.fractions == [(0.25, torch.device("cuda", 1))]
    assert fake.fractions[-1] == (1.0, torch.device("cuda", 1))  # the whole device again after the block
    with backend_of("cuda").capped(torch.device("cuda", 0), 32000):
        pass
    assert fake.fractions[-2] == (1.0, torch.device("cuda", 0))  # at most the whole device
    assert knows_memory("cuda") and knows_memory(torch.device("cuda"))


def test_a_simulated_device_has_the_declared_memory_and_runs_out_beyond_it():
    weights = torch.ones(1024)  # allocated before the block: not counted
    assert not knows_memory("cpu")  # the system's memory is no device's own
    with simulated_memory(total=1_000_000, free=600_000):
        assert knows_memory("cpu") and total_bytes("cpu") == 1_000_000 and free_bytes("cpu") == 600_000
        held = torch.ones(50_000)  # 200,000 bytes: free falls by them
        assert free_bytes("cpu") == 400_000 - 192  # sizes rounded up to 512-byte blocks, as on CUDA
        with track_peak_memory("cpu") as mem:  # a measured call inside sees only its own bytes
            _ = (held * 2).sum()
        assert mem.peak_bytes == 200_192 + 512
        with pytest.raises(torch.OutOfMemoryError, match="exceed limit_bytes=600000"):
            torch.zeros(150_000) + weights.sum()
        with pytest.raises(RuntimeError, match="simulated_memory should not be nested"), simulated_memory(total=10):
            pass
    assert not knows_memory("cpu") and free_bytes("cpu") > 10**6
    with pytest.raises(ValueError, match=r"free should be at most total=100, but got free=200"), \
            simulated_memory(total=100, free=200):
        pass
    with pytest.raises(ValueError, match=r"total should be a number of bytes >= 1, but got total=0"), \
            simulated_memory(total=0):
        pass


def test_a_tracker_inside_another_leaves_the_outer_blocks_peak_whole(monkeypatch):
    # One peak statistic per device, cleared by every reset: the inner block (a measured run inside a measured
    # job) must not wipe what the outer block held before it, nor hide its own peak from the outer one.
    fake = _FakeAllocator(held=1000).install(monkeypatch, torch.cuda)
    with track_peak_memory("cuda") as outer:
        fake.alloc(700)
        fake.release(700)  # the outer block's peak so far: 700, gone before the inner block starts
        with track_peak_memory("cuda") as inner:
            fake.alloc(200)
            inner.mark()
            fake.alloc(100)
            fake.release(300)
        fake.alloc(50)
        outer.mark()
        with track_peak_memory("cuda"):
            fake.alloc(900)
            fake.release(900)
        fake.release(50)
    assert inner.segment_peaks == [200, 300] and inner.peak_bytes == 300
    assert outer.segment_peaks == [700, 950] and outer.peak_bytes == 950


def test_the_first_peak_reset_of_a_process_sets_the_allocator_up_first(monkeypatch):
    # torch.cuda.reset_peak_memory_stats raises before any other CUDA call of the process; bionemo's API resets first
    fake = _FakeAllocator(held=0, initialized=False).install(monkeypatch, torch.cuda)
    features, peaks = collect_cuda_peak_alloc([3], lambda n: fake.alloc(n * 512) or n, torch.device("cuda"))
    assert features == [3] and peaks == [1536]


def test_a_missing_accelerator_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device should be an available device \(torch.xpu.is_available\(\) is "
                                         r"False: no XPU device here\), but got device='xpu'"):
        check_device("device", "xpu")


def test_mps_reports_free_memory_but_cannot_be_measured(monkeypatch):
    for name, fn in {"is_available": lambda: True, "recommended_max_memory": lambda: 16000,
                     "driver_allocated_memory": lambda: 6000, "current_allocated_memory": lambda: 4000}.items():
        monkeypatch.setattr(torch.mps, name, fn)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    assert free_bytes("mps") == 10000 and total_bytes("mps") == 16000
    assert device_in_use() == torch.device("mps") and default_accelerator() == torch.device("mps")
    with pytest.raises(ValueError, match=r"device should be a device whose memory can be measured \('cuda', .*'cpu'\), "
                                         r"but got device='mps'"):
        with track_peak_memory("mps"):
            pass


def test_without_an_accelerator_the_cpu_is_the_device(monkeypatch):
    for kind in ("cuda", "xpu", "mps"):
        monkeypatch.setattr(getattr(torch, kind), "is_available", lambda: False)
    assert device_in_use() is None and default_accelerator() is None
    assert device.default_device() == torch.device("cpu")
    assert 0 < free_bytes("cpu") <= total_bytes("cpu")
    with pytest.raises(ValueError, match=r"device should be a device of a type dynabatch knows \(cpu, cuda, .*mps, "
                                         r"xpu\), but got device='meta'"):
        backend_of("meta")


@pytest.mark.parametrize("message", ["CUDA out of memory. Tried to allocate 2.00 GiB", "HIP out of memory.",
                                     "XPU out of memory, please use `empty_cache`",
                                     "MPS backend out of memory (MPS allocated: 1 GB)",
                                     "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes",
                                     "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
                                     "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"])
def test_every_backends_out_of_memory_error_is_recognised(message):
    assert is_out_of_memory_error(RuntimeError(message)) and is_out_of_memory_error(torch.OutOfMemoryError(message))
    assert not is_out_of_memory_error(RuntimeError("shape mismatch")) and not is_out_of_memory_error(ValueError(message))


def test_a_new_device_type_is_one_registered_class(monkeypatch):
    monkeypatch.setattr(device, "_BACKENDS", dict(device._BACKENDS))  # the registration ends with this test
    fake = _FakeAllocator(held=0)
    monkeypatch.setattr(torch, "hpu", types.SimpleNamespace(**fake.functions()), raising=False)

    @register_backend
    class HpuBackend(AllocatorBackend):
        type = "hpu"
        out_of_memory_messages = ("HPU out of memory",)

    with track_peak_memory("hpu") as mem:
        fake.alloc(4096)
    assert mem.peak_bytes == 4096 and mem.device == torch.device("hpu", 0)
    assert is_out_of_memory_error(RuntimeError("HPU out of memory")) and free_bytes("hpu") == 8000  # no unused cache
    with pytest.raises(TypeError, match="cls should be a DeviceBackend subclass with a type"):
        register_backend(object)


def test_no_module_outside_the_device_layer_calls_a_device_module():
    root = Path(device.__file__).resolve().parents[1]
    call = re.compile(r"\btorch\.(cuda|xpu|mps|hpu)\.\w+\(")
    found = [f"{path.relative_to(root)}:{n}" for path in root.rglob("*.py") if path.name != "device.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if call.search(line)]
    assert found == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_real_gpu_free_bytes_and_out_of_memory_errors():
    held = torch.ones(1024, 1024, device="cuda")
    assert 0 < free_bytes("cuda") <= total_bytes("cuda") and device_in_use() is not None
    try:
        torch.empty(total_bytes("cuda") * 2, dtype=torch.uint8, device="cuda")
    except Exception as exc:  # noqa: BLE001 - the error torch raises is what is checked
        assert is_out_of_memory_error(exc)
    else:
        pytest.fail("allocating twice the device's memory should fail")
    del held


# --- moving batches, device failures -------------------------------------------------------------------------


class _FakeStreams:
    """``torch.cuda``'s stream functions as records: which stream was current when each copy was made, and which
    stream waited on which event."""

    def __init__(self):
        self.log = []
        self.current = "compute"

    def install(self, monkeypatch, module):
        fake = self

        class Stream:
            def __init__(self, device=None):
                self.name = "copy"

            def record_event(self):
                fake.log.append(("record", fake.current))
                return "copied"

            def wait_event(self, event):
                fake.log.append(("wait", self.name, event))

        class Compute(Stream):
            def __init__(self):
                self.name = "compute"

        class Within:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                fake.current = self.stream.name

            def __exit__(self, *exc):
                fake.current = "compute"

        monkeypatch.setattr(module, "is_available", lambda: True, raising=False)
        monkeypatch.setattr(module, "Stream", Stream, raising=False)
        monkeypatch.setattr(module, "current_stream", lambda device=None: Compute(), raising=False)
        monkeypatch.setattr(module, "stream", Within, raising=False)
        return self


def test_a_cuda_copy_runs_on_its_own_stream_and_the_compute_stream_waits_on_its_event(monkeypatch):
    streams = _FakeStreams().install(monkeypatch, torch.cuda)
    copied = []
    real_to = torch.Tensor.to

    def to(tensor, *args, **kwargs):  # no CUDA here: the copy is made on the CPU, noting the stream and the flag
        copied.append((streams.current, kwargs.get("non_blocking")))
        return real_to(tensor, "cpu")

    recorded = []
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: recorded.append(stream.name))
    move = device.copier("cuda:0")
    assert isinstance(move, device.StreamCopier)
    monkeypatch.setattr(move, "device", torch.device("cpu"))  # the copies "land" on the device the tensors are on
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3), "note": "kept"}
    moved = move(batch)
    assert copied == [("copy", True), ("copy", True)]  # both tensors copied on the copy stream, non-blocking
    assert streams.log == [("record", "copy"), ("wait", "compute", "copied")]  # the compute stream waits, not the host
    assert recorded == ["compute", "compute"] and moved["note"] == "kept"  # each copy's memory kept for the compute


def test_the_cpu_and_no_device_copy_plainly():
    assert device.copier(None) is None
    move = device.copier("cpu")
    assert type(move) is device.Copier and not move.non_blocking
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long)}
    assert torch.equal(move(batch)["input_ids"], batch["input_ids"])


def _raised_from(error, cause):
    """``error`` as ``raise error from cause`` leaves it."""
    error.__cause__ = cause
    return error


@pytest.mark.parametrize(
    ("error", "failed"),
    [
        (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), True),
        (RuntimeError("CUDA error: device-side assert triggered"), True),
        (RuntimeError("HIP error: unspecified launch failure"), True),
        (RuntimeError("CUDA error: out of memory"), False),  # out of memory: smaller calls fit
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (ValueError("cannot process this input"), False),  # the work's error, not the device's
        (OSError(28, "No space left on device"), False),
        # a model wrapper's error raised from the runtime's (it was the work's error: a run set its rows aside on
        # a device that fails every later call, where a device failure moves them to another device)
        (_raised_from(RuntimeError("the model failed"), RuntimeError("CUDA error: device-side assert triggered")), True),
        (_raised_from(RuntimeError("the model failed"), torch.OutOfMemoryError("CUDA out of memory")), False),
        (_raised_from(RuntimeError("bad row"), ValueError("cannot process this input")), False),
    ],
)
def test_a_device_failure_is_the_runtimes_error_never_out_of_memory_nor_the_works(error, failed):
    assert device.is_device_failure(error) is failed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_real_gpu_a_pinned_batch_copies_on_its_own_stream_and_computes_after_it():
    move = device.copier("cuda")
    batch = {"input_ids": torch.arange(4096 * 64).reshape(4096, 64).pin_memory()}
    moved = move(batch)
    assert moved["input_ids"].device.type == "cuda" and move.stream != torch.cuda.current_stream()
    total = moved["input_ids"].sum()  # on the compute stream, after the copy's event
    assert int(total) == int(batch["input_ids"].sum())
