"""What every command line shares: the argument parser class, argument types, progress lines on
stderr, and reading a text file the user named.

Runs in: the user's process (the ``powerinfer`` and ``powerinfer-server`` commands and the tools
they start).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from powerinfer.errors import PowerInferError


class Parser(argparse.ArgumentParser):
    """argparse, with its usage errors as one line like our other errors (status 2 as argparse's)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def progress(msg: str) -> None:
    """A progress line for the user, on stderr (stdout carries the command's result)."""
    print(msg, file=sys.stderr, flush=True)


def read_text(path: str) -> str:
    """A UTF-8 text file the user named; a clear error when it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PowerInferError(f"cannot read text file {path}: {e}") from None
