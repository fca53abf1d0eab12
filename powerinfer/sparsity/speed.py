"""Sparse against dense decode speed, measured side by side in one process (`powerinfer bench --vs-dense`).

Runs in: the user's process (the coordinator of both engines; with the process executor each
engine also has its workers).

Both engines are loaded from the same file, one dense and one with the predictor, and decode the
same greedy continuation of the same prompt in alternating rounds (dense first in even rounds,
sparse first in odd ones). A shared machine's speed drifts by tens of percent over minutes; the
ratio of two adjacent runs cancels most of that drift, so the figure reported is the median of
the per-round ratios, with its quartiles, next to each engine's median tokens/s.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# Deterministic prompt material, repeated to the requested length.
_TEXT = (
    "The history of computing is a story of machines that learned to do arithmetic faster than people, "
    "then to store programs, then to talk to each other across the world. Each step made memory and "
    "bandwidth, not raw arithmetic, the limit that mattered. "
)


@dataclass(frozen=True)
class SpeedComparison:
    """What one `--vs-dense` run measured."""

    model: str
    predictor: str
    mode: str  # the predictor's mode: "gate" or "predictor"
    target_sparsity: float
    executor: str
    threads: int
    rounds: int
    gen_tokens: int
    dense_tps: float  # median decode tokens/s over the rounds
    sparse_tps: float
    ratio_median: float  # median over rounds of sparse tokens/s / dense tokens/s of the same round
    ratio_p25: float
    ratio_p75: float
    sparse_faster_rounds: int
    decode_share: float  # share of FFN neurons the sparse engine computed per decode step (1.0: unknown)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def report(self) -> str:
        share = f"{self.decode_share:.1%}" if self.decode_share < 1.0 else "n/a"
        return "\n".join([
            f"model: {self.model}  predictor: {self.predictor} ({self.mode} mode, target sparsity {self.target_sparsity:.2f})",
            f"executor: {self.executor}  threads: {self.threads}  rounds: {self.rounds} x {self.gen_tokens} decode tokens, alternating",
            f"decode tokens/s (median): dense {self.dense_tps:.1f}  sparse {self.sparse_tps:.1f}",
            f"sparse / dense, paired per round: {self.ratio_median:.3f} (quartiles {self.ratio_p25:.3f} - {self.ratio_p75:.3f}); "
            f"sparse faster in {self.sparse_faster_rounds} of {self.rounds} rounds",
            f"FFN neurons computed per sparse decode step: {share}",
        ])


def _decode_tps(llm: Any, ids: list[int], gen_tokens: int) -> float:
    """Prefill ids (not timed), then greedily decode gen_tokens tokens; returns their tokens/s."""
    eng = llm.engine
    eng.rewind(0)
    token = int(np.argmax(eng.eval(ids)[-1]))
    t = time.perf_counter()
    for _ in range(gen_tokens):  # never stops at end-of-text, so every run does equal work
        token = int(np.argmax(eng.eval([token])[-1]))
    return gen_tokens / (time.perf_counter() - t)


def compare_decode(model: str, predictor: str, threads: int = 2, executor: str = "inprocess", prompt_tokens: int = 64,
                   gen_tokens: int = 32, rounds: int = 12, worker_threads: int = 1) -> SpeedComparison:
    """Load `model` dense and with `predictor`, alternate decode rounds, return the figures."""
    from powerinfer.api import LLM

    if rounds < 2:
        raise ValueError("a paired comparison needs at least 2 rounds")
    kwargs: dict[str, Any] = dict(n_ctx=prompt_tokens + gen_tokens + 8, n_threads=threads, executor=executor, worker_threads=worker_threads)
    dense = LLM(model, **kwargs)
    try:
        sparse = LLM(model, predictor=predictor, **kwargs)
    except BaseException:
        dense.close()
        raise
    try:
        assert sparse.predictor is not None
        ids = dense.tokenize(_TEXT * (1 + prompt_tokens // 20))[:prompt_tokens]
        _decode_tps(dense, ids, 2)  # first calls build kernels and touch pages: not measured
        _decode_tps(sparse, ids, 2)
        d_tps, s_tps = [], []
        for r in range(rounds):
            first_dense = r % 2 == 0
            for is_dense in (first_dense, not first_dense):
                (d_tps if is_dense else s_tps).append(_decode_tps(dense if is_dense else sparse, ids, gen_tokens))
            log.info("round %d: dense %.1f, sparse %.1f tokens/s", r, d_tps[-1], s_tps[-1])
        ratios = np.array(s_tps) / np.array(d_tps)
        return SpeedComparison(
            model=dense.config.name, predictor=str(predictor), mode=sparse.predictor.mode,
            target_sparsity=float(sparse.predictor.target_sparsity), executor=executor, threads=threads, rounds=rounds,
            gen_tokens=gen_tokens, dense_tps=round(statistics.median(d_tps), 2), sparse_tps=round(statistics.median(s_tps), 2),
            ratio_median=round(float(np.median(ratios)), 4), ratio_p25=round(float(np.percentile(ratios, 25)), 4),
            ratio_p75=round(float(np.percentile(ratios, 75)), 4), sparse_faster_rounds=int((ratios > 1).sum()),
            decode_share=_share(sparse),
        )
    finally:
        sparse.close()
        dense.close()


def _share(llm: Any) -> float:
    """Share of FFN neurons computed per decode step so far (1.0 when the executor cannot say)."""
    share = getattr(llm.engine.executor, "decode_share", None)
    return float(share()) if callable(share) else 1.0
