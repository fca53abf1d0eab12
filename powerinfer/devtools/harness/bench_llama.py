"""`powerinfer bench --vs-llama-cpp`: our engine against llama.cpp on the same file, paired rounds.

Runs in: the user's process (our engine, in process or with its workers); llama.cpp runs in a
child process of its own (powerinfer/sparsity/llama_cpp_runner.py) with the same thread count.

Each round prefills the same prompt from an empty cache and then greedily decodes the same number
of tokens, in both engines, alternating which goes first. This VM's speed drifts by tens of
percent over minutes, so the figures are the medians of the per-round ratios (with quartiles),
next to each engine's median tokens/s. Decode is memory-bound: the report gives the weight bytes
one decode step reads, the GB/s each engine reaches with them, and the machine's streaming-read
bandwidth measured with the same thread count.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from powerinfer.errors import InvalidArgumentError
from powerinfer.sparsity.llama_cpp_runner import LlamaCppClient
from powerinfer.sparsity.speed import PROMPT_TEXT, read_bandwidth, timed_run

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Paired:
    ours_tps: float  # median over rounds
    llama_cpp_tps: float
    ratio: float  # median over rounds of ours / llama.cpp in the same round
    p25: float
    p75: float
    ours_faster_rounds: int


def paired(ours: list[float], theirs: list[float]) -> Paired:
    r = np.array(ours) / np.array(theirs)
    return Paired(round(statistics.median(ours), 2), round(statistics.median(theirs), 2), round(float(np.median(r)), 4),
                  round(float(np.percentile(r, 25)), 4), round(float(np.percentile(r, 75)), 4), int((r > 1).sum()))


@dataclass(frozen=True)
class VersusLlamaCpp:
    model: str
    executor: str  # "native", "torch" (in process) or "process"
    threads: int
    rounds: int
    prompt_tokens: int
    gen_tokens: int
    decode: Paired
    prefill: Paired
    weight_bytes_per_token: int
    read_bandwidth_gbs: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def report(self) -> str:
        gb = self.weight_bytes_per_token / 1e9
        d, p = self.decode, self.prefill
        ceiling = self.read_bandwidth_gbs / gb
        return "\n".join([
            f"model: {self.model}  ours: {self.executor}  threads: {self.threads}  rounds: {self.rounds} "
            f"(prefill {self.prompt_tokens} tokens, then {self.gen_tokens} decode steps; alternating)",
            f"decode tokens/s (median): ours {d.ours_tps:.1f}  llama.cpp {d.llama_cpp_tps:.1f}  "
            f"ours / llama.cpp paired: {d.ratio:.3f} (quartiles {d.p25:.3f} - {d.p75:.3f}), ours faster in {d.ours_faster_rounds} of {self.rounds}",
            f"prefill tokens/s (median): ours {p.ours_tps:.1f}  llama.cpp {p.llama_cpp_tps:.1f}  "
            f"ours / llama.cpp paired: {p.ratio:.3f} (quartiles {p.p25:.3f} - {p.p75:.3f}), ours faster in {p.ours_faster_rounds} of {self.rounds}",
            f"weights read per decode step: {self.weight_bytes_per_token / 2**20:.1f} MiB -> ours {d.ours_tps * gb:.1f} GB/s, "
            f"llama.cpp {d.llama_cpp_tps * gb:.1f} GB/s; streaming read with {self.threads} threads {self.read_bandwidth_gbs:.1f} GB/s "
            f"(decode ceiling {ceiling:.0f} tokens/s)",
        ])


def compare_llama_cpp(model: str, threads: int = 2, executor: str = "inprocess", prompt_tokens: int = 256, gen_tokens: int = 64,
                      rounds: int = 8, n_batch: int = 512) -> VersusLlamaCpp:
    from powerinfer.api import LLM
    from powerinfer.coordinator.native_executor import NativeExecutor
    from powerinfer.model.weights import decode_weight_bytes

    if rounds < 2:
        raise InvalidArgumentError(f"a paired comparison needs at least 2 rounds, got {rounds}")
    n_ctx = prompt_tokens + gen_tokens + 8
    ref = LlamaCppClient(model, threads, n_ctx)
    try:
        llm = LLM(model, n_ctx=n_ctx, n_batch=n_batch, n_threads=threads, executor=executor)
    except BaseException:
        ref.close()
        raise
    try:
        kind = executor if executor == "process" else ("native" if isinstance(llm.engine.executor, NativeExecutor) else "torch")
        ids = llm.tokenize(PROMPT_TEXT * (1 + prompt_tokens // 20))[:prompt_tokens]
        timed_run(llm, ids, 2)  # first calls touch pages and build caches: not measured
        ref.run(ids, 2)
        ours: list[tuple[float, float]] = []
        theirs: list[tuple[float, float]] = []
        for r in range(rounds):
            first, second = (lambda: ours.append(timed_run(llm, ids, gen_tokens))), (lambda: theirs.append(ref.run(ids, gen_tokens)))
            for run in ((first, second) if r % 2 == 0 else (second, first)):
                run()
            log.info("round %d: ours %.1f / %.1f, llama.cpp %.1f / %.1f (prefill / decode tokens/s)", r, *ours[-1], *theirs[-1])
        cfg = llm.config
        return VersusLlamaCpp(
            model=cfg.name, executor=kind, threads=threads, rounds=rounds, prompt_tokens=len(ids), gen_tokens=gen_tokens,
            decode=paired([o[1] for o in ours], [t[1] for t in theirs]), prefill=paired([o[0] for o in ours], [t[0] for t in theirs]),
            weight_bytes_per_token=decode_weight_bytes(llm.file, cfg.n_layers, cfg.tied_embeddings),
            read_bandwidth_gbs=round(read_bandwidth(threads), 2),
        )
    finally:
        ref.close()
        llm.close()
