"""Typed errors shared by every process of PowerInfer-Py.

Runs in: any process. Each error's message is one line meant for the user; the CLI prints
``error: <message>`` and exits non-zero instead of showing a traceback for these.
"""

from __future__ import annotations


class PowerInferError(Exception):
    """Base class of every expected, user-facing error."""


class ModelFileError(PowerInferError):
    """A model or predictor file is missing, unreadable, malformed or truncated."""


class UnsupportedModelError(PowerInferError):
    """The file is well formed but uses an architecture or tensor type we do not support."""


class TokenizerError(PowerInferError):
    """The tokenizer described by the file cannot be built or used."""


class ChatTemplateError(PowerInferError):
    """The chat template failed to render (bad syntax, unsafe access, raise_exception)."""


class FetchError(PowerInferError):
    """A model could not be fetched (offline, package missing, pip failed)."""


class ChecksumError(FetchError):
    """A fetched or cached model file does not have the expected sha256."""


class ContextOverflowError(PowerInferError):
    """A request needs more positions than the context (``-c/--ctx-size``) holds."""


class InvalidArgumentError(PowerInferError):
    """A parameter value is out of range (sampling settings, sizes, counts)."""
