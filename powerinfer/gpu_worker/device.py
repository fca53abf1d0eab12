"""Finding an NVIDIA GPU through pycuda (the optional `gpu` extra), without ever failing on import.

Runs in: the coordinator (to validate -ngl / --vram-budget) and, later, the GPU worker process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPUProbe:
    name: str | None  # "NVIDIA H200 (139.8 GiB)" or None when there is no usable GPU
    reason: str  # why not, for the error message


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
