"""Finding an NVIDIA GPU through pycuda (the optional `gpu` extra), without ever failing on import.

Runs in: the coordinator (to validate -ngl / --vram-budget and pick the default budget) and the
GPU worker process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from powerinfer.gpu_worker.errors import GpuUnavailableError

log = logging.getLogger(__name__)

MARGIN_BYTES = 1 << 30  # default budget = free memory minus this and MARGIN_SHARE of the card:
MARGIN_SHARE = 0.05  # the worker's CUDA context, module code and allocator slack live outside it


@dataclass(frozen=True)
class GPUProbe:
    name: str | None  # "NVIDIA H200 (139.8 GiB)" or None when there is no usable GPU
    reason: str  # why not, for the error message


@dataclass(frozen=True)
class DeviceMemory:
    name: str
    free: int  # bytes
    total: int

    def default_budget(self) -> int:
        return max(self.free // 2, self.free - MARGIN_BYTES - int(MARGIN_SHARE * self.total))


def find_gpu() -> GPUProbe:
    try:
        import pycuda.driver as cuda  # type: ignore[import-not-found]
    except ImportError:
        return GPUProbe(None, "pycuda is not installed: pip install 'powerinfer[gpu]' on a CUDA machine")
    try:
        cuda.init()
        if cuda.Device.count() == 0:
            return GPUProbe(None, "CUDA reports no device")
        dev = cuda.Device(0)
        return GPUProbe(f"{dev.name()} ({dev.total_memory() / 2**30:.1f} GiB)", "")
    except Exception as e:  # noqa: BLE001 - any driver failure means "no usable GPU", reported as such
        return GPUProbe(None, f"CUDA initialisation failed: {e}")


def device_memory(device: int = 0) -> DeviceMemory:
    """Free and total memory of a GPU, through a context that is destroyed again at once (the GPU
    worker makes its own); GpuUnavailableError when there is none."""
    probe = find_gpu()
    if probe.name is None:
        raise GpuUnavailableError(f"no usable GPU: {probe.reason}")
    import pycuda.driver as cuda

    dev = cuda.Device(device)
    ctx = dev.make_context()
    try:
        free, total = cuda.mem_get_info()
    finally:
        ctx.pop()
        ctx.detach()
    return DeviceMemory(dev.name(), int(free), int(total))
