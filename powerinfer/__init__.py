"""PowerInfer-Py: activation-sparse LLM inference on consumer hardware.

Runs in: whichever process imports it. The public API is :class:`LLM`; errors users may catch
live in :mod:`powerinfer.errors`. Attributes load lazily so that light commands (``powerinfer
fetch``) and worker processes do not pay for importing the whole engine.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LLM", "GenerationChunk", "PowerInferError", "SamplingParams"]
__version__ = "0.1.0"

_LAZY = {
    "LLM": "powerinfer.api",
    "GenerationChunk": "powerinfer.generation",
    "PowerInferError": "powerinfer.errors",
    "SamplingParams": "powerinfer.sampling",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'powerinfer' has no attribute {name!r}")
