"""Typed errors shared by every process of PowerInfer-Py.

Runs in: any process. Each error's message is one line meant for the user; the CLI prints
``error: <message>`` and exits non-zero instead of showing a traceback for these.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]


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


class DiskWriteError(PowerInferError):
    """An output file (a predictor) could not be written: disk full, no permission, no such folder."""


class ContextOverflowError(PowerInferError):
    """A request needs more positions than the context (``-c/--ctx-size``) holds."""


class InvalidArgumentError(PowerInferError):
    """A parameter value is out of range (sampling settings, sizes, counts)."""


def quoted(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters.

    Names and values in messages often come from the file (keys, tensor names, architecture
    strings), which may be megabytes long or hold control characters; repr escapes the latter,
    and the cut keeps the message one readable line.
    """
    text = repr(value)
    if "\n" in text:  # numpy arrays (and long containers) repr over several lines
        text = " ".join(text.split())
    if len(text) <= limit:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, (str, bytes)) else ""
    return f"{text[: limit - 3]}...{size}"


def file_mode(path: Path) -> int:
    """The permissions for a file written atomically over path: those of the file it replaces, else
    what a new file gets from the umask (0666 & ~umask; mkstemp's own 0600 would hide it from others)."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def write_failure(e: OSError, folder: str | Path) -> str:
    """Why a write into ``folder`` failed, for a one-line message: "no space left on device" when
    the disk (or quota, or file size limit) is full, else the system's reason."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on device"
    if e.errno == errno.EFBIG:
        return "no space left for the file (file size limit reached)"
    if e.errno is None:  # numpy's tofile reports a short write without an errno: look around
        try:
            if shutil.disk_usage(folder).free < (1 << 20):
                return "no space left on device"
        except OSError:
            pass
        if resource is not None and resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
            return f"no space left for the file (file size limit reached: {e})"
        return f"short write, is the disk full? ({e})"
    return " ".join(str(e.strerror or e).split())
