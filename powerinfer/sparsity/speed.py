"""Sparse against dense decode speed, measured side by side in one process (`powerinfer bench --vs-dense`).

Runs in: the user's process (the coordinator of both engines; with the process executor each
engine also has its workers).

Both engines are loaded from the same file, one dense and one with the predictor, and decode the
same greedy continuation of the same prompt in alternating rounds (dense first in even rounds,
sparse first in odd ones). A shared machine's speed drifts by tens of percent over minutes; the
ratio of two adjacent runs cancels most of that drift, so the figure reported is the median of
the per-round ratios, with its quartiles, next to each engine's median tokens/s. With
``llama_cpp=True`` llama.cpp (through llama-cpp-python, if installed, in a child process of its own)
decodes the same tokens from the same file with the same thread count in the same rounds.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from powerinfer.errors import InvalidArgumentError
from powerinfer.sparsity.llama_cpp_runner import LlamaCppClient

log = logging.getLogger(__name__)

# Deterministic prompt material, repeated to the requested length (also `powerinfer bench`'s).
PROMPT_TEXT = (
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
    llama_cpp_tps: float | None = None  # median decode tokens/s of llama.cpp on the same file, when measured
    sparse_vs_llama_cpp: float | None = None  # median over rounds of sparse / llama.cpp tokens/s

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
        ] + ([] if self.llama_cpp_tps is None else [
            f"llama.cpp (llama-cpp-python) on the same file, same threads, same rounds: {self.llama_cpp_tps:.1f} tokens/s; "
            f"sparse / llama.cpp, paired per round: {self.sparse_vs_llama_cpp:.3f}",
        ]))


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
                   gen_tokens: int = 32, rounds: int = 12, worker_threads: int = 1, llama_cpp: bool = False) -> SpeedComparison:
    """Load `model` dense and with `predictor` (and in llama.cpp), alternate decode rounds, return the figures."""
    from powerinfer.api import LLM

    if rounds < 2:
        raise InvalidArgumentError(f"a paired comparison needs at least 2 rounds, got {rounds}")
    kwargs: dict[str, Any] = dict(n_ctx=prompt_tokens + gen_tokens + 8, n_threads=threads, executor=executor, worker_threads=worker_threads)
    dense = LLM(model, **kwargs)
    try:
        sparse = LLM(model, predictor=predictor, **kwargs)
    except BaseException:
        dense.close()
        raise
    ref: LlamaCppClient | None = None
    try:
        assert sparse.predictor is not None
        ids = dense.tokenize(PROMPT_TEXT * (1 + prompt_tokens // 20))[:prompt_tokens]
        ref = LlamaCppClient(model, threads, prompt_tokens + gen_tokens + 8) if llama_cpp else None
        runners: dict[str, Callable[[], float]] = {
            "dense": lambda: _decode_tps(dense, ids, gen_tokens),
            "sparse": lambda: _decode_tps(sparse, ids, gen_tokens),
        }
        if ref is not None:
            runners["llama.cpp"] = lambda: ref.decode_tps(ids, gen_tokens)  # type: ignore[union-attr]
        _decode_tps(dense, ids, 2)  # first calls build kernels and touch pages: not measured
        _decode_tps(sparse, ids, 2)
        tps: dict[str, list[float]] = {name: [] for name in runners}
        order = list(runners)
        for r in range(rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                tps[name].append(runners[name]())
            log.info("round %d: %s", r, ", ".join(f"{k} {v[-1]:.1f}" for k, v in tps.items()))
        d_tps, s_tps = tps["dense"], tps["sparse"]
        ratios = np.array(s_tps) / np.array(d_tps)
        return SpeedComparison(
            model=dense.config.name, predictor=str(predictor), mode=sparse.predictor.mode,
            target_sparsity=float(sparse.predictor.target_sparsity), executor=executor, threads=threads, rounds=rounds,
            gen_tokens=gen_tokens, dense_tps=round(statistics.median(d_tps), 2), sparse_tps=round(statistics.median(s_tps), 2),
            ratio_median=round(float(np.median(ratios)), 4), ratio_p25=round(float(np.percentile(ratios, 25)), 4),
            ratio_p75=round(float(np.percentile(ratios, 75)), 4), sparse_faster_rounds=int((ratios > 1).sum()),
            decode_share=_share(sparse),
            llama_cpp_tps=round(statistics.median(tps["llama.cpp"]), 2) if ref is not None else None,
            sparse_vs_llama_cpp=round(float(np.median(np.array(s_tps) / np.array(tps["llama.cpp"]))), 4) if ref is not None else None,
        )
    finally:
        if ref is not None:
            ref.close()
        sparse.close()
        dense.close()


def _share(llm: Any) -> float:
    """Share of FFN neurons computed per decode step so far (1.0 when the executor cannot say)."""
    share = getattr(llm.engine.executor, "decode_share", None)
    return float(share()) if callable(share) else 1.0
