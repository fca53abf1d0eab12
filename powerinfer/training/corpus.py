"""The training text: the Python 3.11 documentation's reStructuredText sources, from Debian's
``python3.11-doc`` package (``apt-get install python3.11-doc``), about 12 MB of English prose.

Runs in: the CLI process (``powerinfer train-relu``).

Every file goes wholly to training or to the held-out text, by a hash of its path (a tenth held
out), so the held-out text is documents the model never saw. The files are read in sorted order
and joined with blank lines: the same package version gives the same text, whose sha256 the
training summary records.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from powerinfer.errors import InvalidArgumentError

DEFAULT_CORPUS = Path("/usr/share/doc/python3.11/html/_sources")
HELD_OUT_EVERY = 10  # one file in ten, by path hash


@dataclass(frozen=True)
class Corpus:
    train: str
    held_out: str
    files: int
    sha256: str  # of train + "\0" + held_out


def _held_out(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % HELD_OUT_EVERY == 0


def read_corpus(folder: Path = DEFAULT_CORPUS, max_files: int = 0) -> Corpus:
    """The corpus under folder (its *.txt files; max_files > 0: only the first that many, sorted)."""
    if not folder.is_dir():
        raise InvalidArgumentError(f"no training text at {folder}: install it with `apt-get install python3.11-doc` "
                                   f"(Debian's Python documentation), or give --corpus DIR with .txt files")
    files = sorted(p for p in folder.rglob("*.txt") if p.is_file())
    if max_files:
        files = files[:max_files]
    if not files:
        raise InvalidArgumentError(f"no .txt files under {folder}")
    train, held = [], []
    for p in files:
        rel = p.relative_to(folder).as_posix()
        (held if _held_out(rel) else train).append(p.read_text(encoding="utf-8", errors="replace"))
    if not train or not held:
        raise InvalidArgumentError(f"{folder}: {len(files)} files are too few to split into training and held-out text")
    t, h = "\n\n".join(train), "\n\n".join(held)
    return Corpus(t, h, len(files), hashlib.sha256((t + "\0" + h).encode()).hexdigest())
