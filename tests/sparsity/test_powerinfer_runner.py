"""PowerInfer's main timed per round (`bench --sparse --vs-powerinfer`): its timing lines parsed, a
missing binary refused, and the rounds plumbed through compare_decode with a stand-in binary.

Runs in: the pytest process; the stand-in ``main`` is a shell script printing PowerInfer's lines
(the real binary is built from source by hand: docs/powerinfer-models.md).
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Callable

import pytest

from powerinfer.errors import PowerInferError
from powerinfer.predictors.predictor_file import write_predictor
from powerinfer.sparsity.calibrate import CalibrationSettings, calibrate
from powerinfer.sparsity.powerinfer_runner import PowerInferMain, find_main, parse_timings
from powerinfer.sparsity.speed import compare_decode

# What PowerInfer's main (llama.cpp of late 2023) prints at exit, to stderr.
TIMINGS = """\
llama_print_timings:        load time =     123.45 ms
llama_print_timings:      sample time =       1.23 ms /    32 runs   (    0.04 ms per token, 26016.26 tokens per second)
llama_print_timings: prompt eval time =     500.00 ms /    10 tokens (   50.00 ms per token,    20.00 tokens per second)
llama_print_timings:        eval time =    1240.00 ms /    31 runs   (   40.00 ms per token,    25.00 tokens per second)
llama_print_timings:       total time =    1800.00 ms
"""


def test_parse_timings() -> None:
    assert parse_timings(TIMINGS) == pytest.approx((20.0, 25.0))
    with pytest.raises(PowerInferError, match="no prompt and decode timings"):
        parse_timings("llama_print_timings:        load time =     123.45 ms\n")


def _stand_in(tmp_path: Path, body: str) -> Path:
    main = tmp_path / "build" / "bin" / "main"
    main.parent.mkdir(parents=True)
    main.write_text("#!/bin/sh\n" + body)
    main.chmod(main.stat().st_mode | stat.S_IEXEC)
    return main


def test_find_main_and_failures(tmp_path: Path) -> None:
    with pytest.raises(PowerInferError, match="not PowerInfer's main"):
        find_main(tmp_path)
    main = _stand_in(tmp_path, 'echo "error: unknown model architecture" >&2; exit 1\n')
    assert find_main(tmp_path) == main and find_main(main) == main
    with pytest.raises(PowerInferError, match="unknown model architecture"):
        PowerInferMain(tmp_path, tmp_path / "m.powerinfer.gguf", 1, 64).run("Hello", 4)


def test_rounds_through_compare_decode(make_model: Callable[..., Path], tmp_path: Path) -> None:
    """The stand-in records its arguments: greedy, the thread count, the prompt as text, -n steps."""
    log = tmp_path / "args.txt"
    _stand_in(tmp_path, f'echo "$@" >> {log}\ncat >&2 <<"EOF"\n{TIMINGS}EOF\n')
    model = make_model(arch="llama", n_layers=2)
    pred = tmp_path / "m.predictor"
    write_predictor(pred, calibrate(model, CalibrationSettings(mode="gate", sparsity=0.8, tokens=32, window=32, steps=1)))
    cmp = compare_decode(str(model), str(pred), threads=1, prompt_tokens=8, gen_tokens=3, rounds=2,
                         powerinfer=(str(tmp_path), str(model)))
    assert cmp.powerinfer_tps == pytest.approx(25.0) and cmp.powerinfer_prefill_tps == pytest.approx(20.0)
    assert cmp.sparse_vs_powerinfer is not None and cmp.sparse_vs_powerinfer > 0
    assert "PowerInfer's CPU build on this model and predictor in its layout (PWRI)" in cmp.report()
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and all(f"-m {model} " in c and " -n 3 -t 1 " in c and "--temp 0" in c and "--ignore-eos" in c for c in calls)
