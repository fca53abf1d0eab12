"""Every flag of every command says what it does in --help (issue 33: `sparsity-curve -m` and
`bench -b` had none), and --version answers on the commands.

Runs in: the pytest process; each command's parser is captured at its parse_args call, so no model
is loaded and nothing runs.
"""

from __future__ import annotations

import argparse
from typing import Callable, Sequence

import pytest

from powerinfer.cli.main import COMMANDS, run_generate
from powerinfer.server.main import main as server_main


class _Parsed(Exception):
    pass


def _parsers(run: Callable[[Sequence[str]], int], monkeypatch: pytest.MonkeyPatch) -> list[argparse.ArgumentParser]:
    seen: list[argparse.ArgumentParser] = []

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        seen.append(self)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    with pytest.raises(_Parsed):
        run([])
    return seen


RUNNERS = {**COMMANDS, "(generate)": run_generate, "powerinfer-server": server_main}


@pytest.mark.parametrize("name", sorted(RUNNERS))
def test_every_flag_has_help(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parsers = _parsers(RUNNERS[name], monkeypatch)
    missing = []
    for parser in parsers:
        for sub in [parser] + [p for a in parser._actions if isinstance(a, argparse._SubParsersAction) for p in a.choices.values()]:
            missing += [f"{sub.prog} {'/'.join(a.option_strings) or a.dest}" for a in sub._actions
                        if not a.help and not isinstance(a, argparse._SubParsersAction)]
    assert parsers and not missing, missing
