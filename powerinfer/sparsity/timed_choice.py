"""Choosing a sparse rule by its decode speed on this machine: candidate predictors against gate mode.

Runs in: the calibrating process (`powerinfer calibrate`, budget.py's search in mode 'auto'); the
timing starts the default executor's worker processes, one pool per rule.

What a chosen (scattered) row costs against a streamed one differs from CPU to CPU and from
executor to executor, so whether a predictor that reads fewer bytes than gate mode also decodes
faster is measured, not modelled: paired alternating rounds, the median of the per-round ratios.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from powerinfer.predictors.predictor_file import PredictorFile
from powerinfer.sparsity.calibrate import Profile

log = logging.getLogger(__name__)

# decode_speedup's paired rounds (~10 s on a 1.1B model, ~1 min on a 7B one, pools' start included)
SPEED_ROUNDS = 6
SPEED_STEPS = 16
SPEED_PROMPT = 16
# a predictor replaces gate mode (which drops only what the exact gate says) when this much faster: not on noise;
# within the noise (from 1 / SPEED_MARGIN) the more accurate of the two (measured: the full trained ReLU model's
# low-rank predictor timed 0.97x gate mode, scored -0.05% against its +0.29% on the calibration's held-out
# tokens, and +0.50% against +1.71% on 20000 unseen ones)
SPEED_MARGIN = 1.05


def decode_speedup(p: Profile, candidate: PredictorFile, base: PredictorFile, prompt: Sequence[int], rounds: int = SPEED_ROUNDS,
                   steps: int = SPEED_STEPS) -> float:
    """How much faster candidate's rule decodes than base's in the engine a user runs (the default
    executor: the native worker pool): the median over rounds of the per-round tokens/s ratio, the
    two alternating (A B, B A, ...), each round steps greedy tokens after prompt. Measured, not
    modelled: what a chosen row costs against a streamed one differs from CPU to CPU (~4x on a Zen 4,
    ~1.3x on a Sapphire Rapids: docs/sparsity.md), and from executor to executor (on an AVX2 EPYC
    the 1.1B file's low-rank predictor decoded at 0.98-1.07x gate mode's speed in process and
    1.05-1.07x in the pool)."""
    from powerinfer.api import LLM
    from powerinfer.predictors.predictor_file import write_predictor
    from powerinfer.sparsity.speed import timed_run

    llms: list[LLM] = []
    ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="powerinfer-speed-") as tmp:
        try:
            for name, pf in (("candidate", candidate), ("base", base)):
                path = Path(tmp) / f"{name}.predictor"
                write_predictor(path, pf)
                llms.append(LLM(p.f.path, predictor=path, n_ctx=len(prompt) + steps + 8))
            for llm in llms:  # first calls touch pages and build kernels
                timed_run(llm, list(prompt), 2)
            for r in range(rounds):
                got = {id(llm): timed_run(llm, list(prompt), steps)[1] for llm in (llms if r % 2 == 0 else llms[::-1])}
                ratios.append(got[id(llms[0])] / got[id(llms[1])])
        finally:
            for llm in llms:
                llm.close()
    speed = float(np.median(ratios))
    log.info("decode speed against gate mode, %d paired rounds of %d tokens: %s -> median %.3f", rounds, steps,
             ", ".join(f"{r:.3f}" for r in ratios), speed)
    return speed


def time_against_gate(p: Profile, candidate: PredictorFile, gate: PredictorFile, prompt: Sequence[int], progress: Callable[[str], None],
           what: str) -> float:
    speed = decode_speedup(p, candidate, gate, prompt)
    progress(f"{what}: decoding at {speed:.2f}x gate mode's speed here ({SPEED_ROUNDS} paired rounds of {SPEED_STEPS} tokens, "
             f"in the default executor; kept from {SPEED_MARGIN:.2f}x, or from {1 / SPEED_MARGIN:.2f}x where it is the more accurate)")
    return speed


def rejection(how: str, ppl: float, limit: float, aim: float, speed: float | None, then: str, more_accurate: bool = False) -> str:
    """Why a candidate predictor (described by how) is not kept, or "" where it is: over the
    budget's aim (limit: the perplexity it must stay within), or timed slower than SPEED_MARGIN
    times gate mode (speed None: not timed, as outside mode 'auto'), unless the timing is within
    its noise (from 1 / SPEED_MARGIN) and the candidate is the more accurate (more_accurate: its
    held-out perplexity below gate mode's at the same levels)."""
    if ppl > limit:
        return f"{how}: over the budget's aim of +{100 * aim:.1f}%{then}"
    if speed is not None and speed < SPEED_MARGIN and not (more_accurate and speed >= 1 / SPEED_MARGIN):
        tie = "" if more_accurate else f", or be as fast within {1 / SPEED_MARGIN:.2f}x and more accurate"
        return f"{how}: it decodes at {speed:.2f}x gate mode's speed here (measured; it must gain {SPEED_MARGIN:.2f}x{tie}){then}"
    return ""


def timed_note(speed: float | None) -> str:
    return "" if speed is None else f"; it decodes at {speed:.2f}x gate mode's speed here (measured)"
