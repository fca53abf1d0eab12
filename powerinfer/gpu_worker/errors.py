"""Typed errors of the GPU worker: running out of (budgeted) GPU memory, an unusable GPU.

Runs in: the GPU worker process and the coordinator (which re-raises what the worker reports).
Both are :class:`powerinfer.errors.PowerInferError`, so the CLI prints one ``error:`` line with
the advice in the message instead of a CUDA traceback.
"""

from __future__ import annotations

from powerinfer.errors import PowerInferError

GIB = float(1 << 30)
ADVICE = "use a smaller --vram-budget or fewer GPU layers (-ngl)"


class GpuMemoryError(PowerInferError):
    """An allocation does not fit the VRAM budget, or the budget does not fit the card."""


class GpuUnavailableError(PowerInferError):
    """No usable GPU (no pycuda, no device, driver failure) for the CUDA backend."""


def gib(n: int | float) -> str:
    return f"{n / GIB:.2f} GiB"


def over_budget(what: str, need: int, used: int, budget: int) -> GpuMemoryError:
    return GpuMemoryError(f"GPU memory: {what} needs {gib(need)} but only {gib(max(0, budget - used))} of the "
                          f"{gib(budget)} VRAM budget is left ({gib(used)} in use); {ADVICE}")


def over_card(budget: int, free: int, device: str) -> GpuMemoryError:
    return GpuMemoryError(f"a VRAM budget of {gib(budget)} is more than the {gib(free)} free on {device}; {ADVICE}")
