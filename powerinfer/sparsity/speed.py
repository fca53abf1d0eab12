"""Sparse against dense decode speed, measured side by side in one process (`powerinfer bench --vs-dense`).

Runs in: the user's process (the coordinator of both engines; with the process executor each
engine also has its workers).

Both engines are loaded from the same file, one dense and one with the predictor, and decode the
same greedy continuation of the same prompt in alternating rounds (dense first in even rounds,
sparse first in odd ones). A shared machine's speed drifts by tens of percent over minutes; the
ratio of two adjacent runs cancels most of that drift, so the figure reported is the median of
the per-round ratios, with its quartiles, next to each engine's median tokens/s. Each round also
times both engines' prefill of the prompt (paired the same way), and after the rounds the sparse
rule is replayed in process on the same tokens to count the weight bytes a decode step reads:
with the tokens/s that gives each engine's GB/s, beside the machine's streaming read bandwidth, and
to time the predictor and count its recall and precision on those steps. With
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
    prompt_tokens: int = 0
    prefill_ratio_median: float | None = None  # median over rounds of sparse / dense prefill tokens/s
    dense_prefill_tps: float | None = None
    sparse_prefill_tps: float | None = None
    dense_bytes: float | None = None  # weight bytes a dense decode step reads
    sparse_bytes: float | None = None  # the same for the sparse rule on the benchmark's tokens
    read_bandwidth_gbs: float | None = None  # the machine's streaming read bandwidth at these threads
    memory_mib: tuple[float, float] | None = None  # (RSS, PSS) of the sparse engine's processes, MiB
    powerinfer_tps: float | None = None  # median decode tokens/s of PowerInfer's CPU build on the PWRI file
    sparse_vs_powerinfer: float | None = None  # median over rounds of sparse / PowerInfer decode tokens/s
    powerinfer_prefill_tps: float | None = None
    predictor_us: float | None = None  # the predictor's time per decode step in the in-process replay
    replay_step_us: float | None = None  # that replay's decode step
    recall: float | None = None  # of the neurons that fired in the replay's decode steps, the share the predictor chose
    precision: float | None = None  # of those it chose, the share that fired

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
        ]) + ([] if self.powerinfer_tps is None else [
            f"PowerInfer's CPU build on this model and predictor in its layout (PWRI), same threads, same rounds: {self.powerinfer_tps:.1f} tokens/s "
            f"(prefill {self.powerinfer_prefill_tps:.1f}); sparse / PowerInfer, paired per round: {self.sparse_vs_powerinfer:.3f}",
        ]) + ([] if self.prefill_ratio_median is None else [
            f"prefill of {self.prompt_tokens} tokens (tokens/s, median): dense {self.dense_prefill_tps:.1f}  sparse "
            f"{self.sparse_prefill_tps:.1f}; sparse / dense, paired per round: {self.prefill_ratio_median:.3f}",
        ]) + ([] if self.dense_bytes is None or self.sparse_bytes is None or self.read_bandwidth_gbs is None else [
            f"weights read per decode step: dense {self.dense_bytes / 2**20:.1f} MiB -> {self.dense_bytes * self.dense_tps / 1e9:.1f} GB/s; "
            f"sparse {self.sparse_bytes / 2**20:.1f} MiB ({self.sparse_bytes / self.dense_bytes:.1%}) -> "
            f"{self.sparse_bytes * self.sparse_tps / 1e9:.1f} GB/s; streaming read bandwidth with {self.threads} threads: "
            f"{self.read_bandwidth_gbs:.1f} GB/s (sparse reaches {self.sparse_bytes * self.sparse_tps / 1e9 / self.read_bandwidth_gbs:.0%})",
        ]) + ([] if self.memory_mib is None else [
            f"sparse engine's memory, all its processes: RSS {self.memory_mib[0]:.0f} MiB, PSS {self.memory_mib[1]:.0f} MiB",
        ]) + ([] if self.predictor_us is None or self.replay_step_us is None or self.recall is None or self.precision is None else [
            f"predictor, in process over the same decode steps: {self.predictor_us:.0f} µs a step ({self.predictor_us / self.replay_step_us:.1%} "
            f"of its {self.replay_step_us:.0f} µs); recall {self.recall:.3f} of the neurons that fired, precision {self.precision:.3f}",
        ]))


def timed_run(llm: Any, ids: list[int], gen_tokens: int) -> tuple[float, float]:
    """Prefill ids, then greedily decode gen_tokens tokens; returns (prefill, decode) tokens/s."""
    eng = llm.engine
    eng.rewind(0)
    t = time.perf_counter()
    token = int(np.argmax(eng.eval(ids)[-1]))
    prefill = len(ids) / (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(gen_tokens):  # never stops at end-of-text, so every run does equal work
        token = int(np.argmax(eng.eval([token])[-1]))
    return prefill, gen_tokens / (time.perf_counter() - t)


def _decode_tps(llm: Any, ids: list[int], gen_tokens: int) -> float:
    return timed_run(llm, ids, gen_tokens)[1]


@dataclass(frozen=True)
class Replay:
    """The sparse rule replayed in process on a benchmark's tokens (replay_decode)."""

    dense_bytes: float  # weight bytes a dense decode step reads
    sparse_bytes: float  # the same for the sparse rule over the replayed steps
    share: float  # share of FFN neurons those steps computed
    step_us: float  # their decode step
    predictor_us: float | None  # of it, the predictor's (None: a gate-rule file has none)
    recall: float | None  # of the neurons that fired in those steps, the share the predictor chose
    precision: float | None  # of those it chose, the share that fired


def replay_decode(model: str, predictor: str, ids: list[int], gen_tokens: int, threads: int) -> Replay:
    """gen_tokens greedy decode steps after ids in the in-process decoder with the predictor: the
    weight bytes they read (the file's matrices, the sparse FFNs' reads counted by the rule) and the
    predictor's time; then the same steps again, each computing every neuron once more, for the
    predictor's recall and precision against the neurons that fired (|act(gate) * up| above the
    layer's threshold)."""
    from powerinfer.api import LLM
    from powerinfer.coordinator.native_executor import NativeExecutor
    from powerinfer.model.weights import decode_weight_bytes

    with LLM(model, predictor=predictor, executor="inprocess", n_ctx=len(ids) + gen_tokens + 8, n_threads=threads) as llm:
        ex = llm.engine.executor
        if not isinstance(ex, NativeExecutor) or ex.sparse is None:
            raise InvalidArgumentError("counting sparse reads needs the native decoder")
        eng, sp = llm.engine, ex.sparse

        def steps() -> float:
            eng.rewind(0)
            token = int(np.argmax(eng.eval(ids)[-1]))
            ex.reset_sparse_counts()
            t0 = time.perf_counter()
            for _ in range(gen_tokens):
                token = int(np.argmax(eng.eval([token])[-1]))
            return (time.perf_counter() - t0) / gen_tokens * 1e6

        sp.track(quality=False, timing=True)
        step_us = steps()
        ffn_sparse, ffn_dense = ex.sparse_bytes()
        total = decode_weight_bytes(llm.file, llm.config.n_layers, llm.config.tied_embeddings)
        share = _share(llm)
        pred_us = float(sp.pred_s.sum()) / gen_tokens * 1e6 if sp.uses_predictor else None
        sp.track(quality=sp.uses_predictor, timing=False)
        steps()  # the same greedy tokens, each step computing every neuron once more (not timed)
        sp.track(quality=False, timing=False)
        tp, fn, fp = (int(v) for v in sp.quality.sum(axis=0))
    recall = tp / (tp + fn) if pred_us is not None and tp + fn else None
    precision = tp / (tp + fp) if pred_us is not None and tp + fp else None
    return Replay(float(total), float(total - ffn_dense + ffn_sparse), share, step_us, pred_us, recall, precision)


def compare_decode(model: str, predictor: str, threads: int = 2, executor: str = "inprocess", prompt_tokens: int = 64,
                   gen_tokens: int = 32, rounds: int = 12, worker_threads: int | None = None, llama_cpp: bool = False,
                   read_bytes: bool = False, powerinfer: tuple[str, str] | None = None) -> SpeedComparison:
    """Load `model` dense and with `predictor` (and in llama.cpp), alternate decode rounds, return the
    figures; read_bytes: also count the bytes a decode step reads and measure the read bandwidth;
    powerinfer (PowerInfer's main or checkout, a PWRI file): PowerInfer decodes in the same rounds."""
    from powerinfer.sparsity.powerinfer_runner import PowerInferMain

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
        runners: dict[str, Callable[[], tuple[float, float]]] = {
            "dense": lambda: timed_run(dense, ids, gen_tokens),
            "sparse": lambda: timed_run(sparse, ids, gen_tokens),
        }
        if ref is not None:
            runners["llama.cpp"] = lambda: (0.0, ref.decode_tps(ids, gen_tokens))  # type: ignore[union-attr]
        if powerinfer is not None:
            pi = PowerInferMain(powerinfer[0], powerinfer[1], threads, prompt_tokens + gen_tokens + 8)
            text = dense.detokenize(ids)  # PowerInfer tokenizes the prompt itself (adding <s> as we do)
            runners["PowerInfer"] = lambda: pi.run(text, gen_tokens)
        _decode_tps(dense, ids, 2)  # first calls build kernels and touch pages: not measured
        _decode_tps(sparse, ids, 2)
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
        order = list(runners)
        for r in range(rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                runs[name].append(runners[name]())
            log.info("round %d (decode tokens/s): %s", r, ", ".join(f"{k} {v[-1][1]:.1f}" for k, v in runs.items()))
        tps = {name: [run[1] for run in v] for name, v in runs.items()}
        d_tps, s_tps = tps["dense"], tps["sparse"]
        ratios = np.array(s_tps) / np.array(d_tps)
        d_pre, s_pre = [run[0] for run in runs["dense"]], [run[0] for run in runs["sparse"]]
        memory = process_memory_mib(sparse)
        if read_bytes:
            replay: Replay | None = replay_decode(model, predictor, ids, gen_tokens, threads)
            bandwidth: float | None = read_bandwidth(threads)
        else:
            replay = bandwidth = None
        # the pool's ranks do not report their counts: the in-process replay of the same rule does
        share = _share(sparse) if _share(sparse) < 1.0 or replay is None else replay.share
        return SpeedComparison(
            model=dense.config.name, predictor=str(predictor), mode=sparse.predictor.mode,
            target_sparsity=float(sparse.predictor.target_sparsity), executor=executor, threads=threads, rounds=rounds,
            gen_tokens=gen_tokens, dense_tps=round(statistics.median(d_tps), 2), sparse_tps=round(statistics.median(s_tps), 2),
            ratio_median=round(float(np.median(ratios)), 4), ratio_p25=round(float(np.percentile(ratios, 25)), 4),
            ratio_p75=round(float(np.percentile(ratios, 75)), 4), sparse_faster_rounds=int((ratios > 1).sum()),
            decode_share=share,
            llama_cpp_tps=round(statistics.median(tps["llama.cpp"]), 2) if ref is not None else None,
            sparse_vs_llama_cpp=round(float(np.median(np.array(s_tps) / np.array(tps["llama.cpp"]))), 4) if ref is not None else None,
            prompt_tokens=len(ids), prefill_ratio_median=round(float(np.median(np.array(s_pre) / np.array(d_pre))), 4),
            dense_prefill_tps=round(statistics.median(d_pre), 2), sparse_prefill_tps=round(statistics.median(s_pre), 2),
            dense_bytes=None if replay is None else replay.dense_bytes, sparse_bytes=None if replay is None else replay.sparse_bytes,
            read_bandwidth_gbs=None if bandwidth is None else round(bandwidth, 2), memory_mib=memory,
            powerinfer_tps=round(statistics.median(tps["PowerInfer"]), 2) if powerinfer else None,
            sparse_vs_powerinfer=round(float(np.median(np.array(s_tps) / np.array(tps["PowerInfer"]))), 4) if powerinfer else None,
            powerinfer_prefill_tps=round(statistics.median(run[0] for run in runs["PowerInfer"]), 2) if powerinfer else None,
            predictor_us=None if replay is None or replay.predictor_us is None else round(replay.predictor_us, 1),
            replay_step_us=None if replay is None else round(replay.step_us, 1),
            recall=None if replay is None or replay.recall is None else round(replay.recall, 4),
            precision=None if replay is None or replay.precision is None else round(replay.precision, 4),
        )
    finally:
        if ref is not None:
            ref.close()
        sparse.close()
        dense.close()


def memory_bandwidth_gbs(n_bytes: int = 256 << 20) -> float:
    """Single-stream read+write bandwidth of this machine (numpy copy), GB/s: the fallback without the native build."""
    src = np.ones(n_bytes // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * n_bytes / best / 1e9


def read_bandwidth(threads: int) -> float:
    """The machine's streaming read bandwidth (GB/s) with this many threads, by the decoder's own probe."""
    from powerinfer.native.decoder_lib import decoder_lib, read_bandwidth_gbs

    lib = decoder_lib()
    return memory_bandwidth_gbs() / 2 if lib is None else read_bandwidth_gbs(lib, threads)  # a copy: half reads


def process_memory_mib(llm: Any) -> tuple[float, float]:
    """(RSS, PSS) in MiB summed over this process and the engine's worker processes."""
    import os

    import psutil

    pids = [os.getpid(), *llm.engine.executor.describe().pids]
    rss = pss = 0.0
    for pid in pids:
        try:
            info = psutil.Process(pid).memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss, pss = rss + info.rss / 2**20, pss + getattr(info, "pss", info.rss) / 2**20
    return round(rss, 1), round(pss, 1)


def _share(llm: Any) -> float:
    """Share of FFN neurons computed per decode step so far (1.0 when the executor cannot say)."""
    share = llm.engine.executor.describe().computed_share
    return 1.0 if share is None else float(share)
