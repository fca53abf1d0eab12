"""Compile a C kernel once per machine and load it: the system compiler, a cache keyed by content.

Runs in: any process that loads a native kernel (CPU workers, the in-process executor, the GPU rank's comm library).

The shared library lands in the user cache directory (``$POWERINFER_CACHE/native``) under a name
that hashes the sources, the flags and the compiler's version, so an upgrade rebuilds and two
processes building at once each write their own temporary file and rename it into place.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from powerinfer.phase import phase

log = logging.getLogger(__name__)


class BuildError(OSError):
    """No compiler, or the compiler refused the source."""


def cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(os.environ.get("POWERINFER_CACHE") or user_cache_dir("powerinfer")) / "native"


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _compile(cc: str, source: Path, flags: Sequence[str], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True, timeout=180)
        if res.returncode != 0:
            raise BuildError(f"{cc} failed: {res.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library(source: Path, headers: Sequence[Path], flags: Sequence[str], stem: str) -> ctypes.CDLL:
    """Build source (which includes headers) with flags unless cached, and load it.

    Raises BuildError without a compiler or when the build fails, OSError when loading fails.
    """
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler found (cc, gcc or clang; or set CC)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{cc} --version failed: {e}") from None
    sources = b"".join(p.read_bytes() for p in (source, *headers))
    key = hashlib.sha256(sources + " ".join(flags).encode() + version.encode()).hexdigest()[:16]
    path = cache_dir() / f"{stem}-{key}.so"
    if not path.exists():
        phase.info("compiling %s, once for this machine and compiler (up to a minute)", source.name)
        log.debug("%s %s", cc, " ".join(flags))
        try:
            _compile(cc, source, flags, path)
        except subprocess.SubprocessError as e:
            raise BuildError(f"{cc} did not finish: {e}") from None
    return ctypes.CDLL(str(path))
