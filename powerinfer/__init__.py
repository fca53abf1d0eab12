"""PowerInfer-Py: activation-sparse LLM inference on consumer hardware.

Runs in: whichever process imports it. The public API is :class:`LLM`; errors users may catch
live in :mod:`powerinfer.errors`.
"""

from powerinfer.api import LLM, GenerationChunk
from powerinfer.errors import PowerInferError
from powerinfer.sampling import SamplingParams

__all__ = ["LLM", "GenerationChunk", "PowerInferError", "SamplingParams"]
__version__ = "0.1.0"
