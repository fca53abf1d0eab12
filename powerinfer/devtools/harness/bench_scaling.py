"""`powerinfer bench --paired`: executors and thread counts side by side, in alternating rounds of one run.

Runs in: the user's process (coordinator of every pool it loads) and their worker processes.

Loads the model once per configuration (the default executor with each --threads count, in the
worker processes split_threads gives it, then the most threads as single-thread worker processes
when the default did not already run them so, and the in-process native decoder with that many
threads), then runs rounds A B C A B C ...
(each: a prompt, then greedy decode steps) and reports per configuration the median tokens/s and
the medians of the per-round ratios against the in-process decoder and against the first thread
count, so the VM's drift cancels out. For the worker pools also: the merge's latency per sync
(median, p99, from the ranks' rings) and the share of the ranks' time spent waiting in merges.
Memory is not reported here:
every configuration shares this process (the non-paired mode measures each alone).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from powerinfer.errors import PowerInferError


@dataclass
class ConfigResult:
    name: str
    threads: int  # the CPU threads it runs (-t)
    decode_tps: list[float] = field(default_factory=list)
    prefill_tps: list[float] = field(default_factory=list)
    merge_median_us: float = 0.0
    merge_p99_us: float = 0.0
    wait_share: float = 0.0
    syncs_per_step: float = 0.0
    rank_wait_shares: list[float] = field(default_factory=list)
    outside_share: float = 0.0  # of a decode step, outside the slowest rank's native code


@dataclass
class ScalingResult:
    model: str
    predictor: str | None
    prompt_tokens: int
    gen_tokens: int
    rounds: int
    configs: list[ConfigResult]

    def ratio(self, a: ConfigResult, b: ConfigResult, what: str = "decode_tps") -> tuple[float, float, float]:
        r = np.array(getattr(a, what)) / np.array(getattr(b, what))
        return float(np.median(r)), float(np.percentile(r, 25)), float(np.percentile(r, 75))

    def report(self) -> str:
        ref = next(c for c in self.configs if c.name.startswith("in-process"))
        first = next(c for c in self.configs if not c.name.startswith("in-process"))
        lines = [f"model: {self.model}  {'sparse: ' + self.predictor if self.predictor else 'dense'}  prompt: {self.prompt_tokens} tokens  decode: {self.gen_tokens} tokens  rounds: {self.rounds} "
                 "(alternating; ratios are medians of per-round ratios, quartiles in brackets)",
                 f"{'configuration':<28}{'decode tok/s':>13}{'prefill tok/s':>14}{'vs in-process':>22}{'vs ' + first.name.split(':')[0]:>26}"
                 f"{'merge med/p99 us':>18}{'wait':>7}{'per rank':>12}{'outside':>9}"]
        for c in self.configs:
            vs_ref = "%.3f (%.3f-%.3f)" % self.ratio(c, ref)
            vs_first = "%.3f (%.3f-%.3f)" % self.ratio(c, first)
            merge = f"{c.merge_median_us:.1f}/{c.merge_p99_us:.1f}" if c.syncs_per_step else "-"
            wait = f"{100 * c.wait_share:.0f}%" if c.syncs_per_step else "-"
            per_rank = "/".join(f"{100 * w:.0f}" for w in c.rank_wait_shares) + "%" if c.syncs_per_step else "-"
            outside = f"{100 * c.outside_share:.0f}%" if c.syncs_per_step else "-"
            lines.append(f"{c.name:<28}{statistics.median(c.decode_tps):>13.1f}{statistics.median(c.prefill_tps):>14.1f}{vs_ref:>22}"
                         f"{vs_first:>26}{merge:>18}{wait:>7}{per_rank:>12}{outside:>9}")
        lines.append("wait: the ranks' native time spent in merges waiting for a peer (per rank: one rank always waiting is an "
                     "imbalance of work); outside: a decode step's wall time outside the slowest rank's native code (doorbell, "
                     "coordinator)")
        lines.append("memory: `powerinfer bench -t ...` (without --paired) measures each configuration alone, all its processes")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "predictor": self.predictor, "prompt_tokens": self.prompt_tokens, "gen_tokens": self.gen_tokens, "rounds": self.rounds,
                "configs": [c.__dict__ for c in self.configs]}


def _layout(workers: int, threads: int) -> str:
    return f"{workers} worker{'s' if workers > 1 else ''} x {threads} thread{'s' if threads > 1 else ''}"


def compare_scaling(model: str, threads: Sequence[int], prompt_tokens: int = 128, gen_tokens: int = 64, rounds: int = 6,
                    worker_threads: int | None = None, n_batch: int = 512, predictor: str | None = None) -> ScalingResult:
    """The default executor at each thread count (worker processes as split_threads lays them out,
    or of worker_threads threads each), the most threads as single-thread worker processes, and the
    in-process decoder, in alternating rounds (every configuration sparse with predictor when one is given)."""
    from powerinfer.api import LLM
    from powerinfer.coordinator.native_pool import NativePoolExecutor
    from powerinfer.cpu_workers.topology import read_topology, split_threads
    from powerinfer.sparsity.speed import PROMPT_TEXT

    if rounds < 2:
        raise PowerInferError("--paired needs at least 2 --rounds")
    n_ctx = prompt_tokens + gen_tokens + 8
    common: dict[str, Any] = dict(n_ctx=n_ctx, n_batch=n_batch, predictor=predictor)
    llms: dict[str, Any] = {}
    results: list[ConfigResult] = []
    try:
        topo = read_topology()
        counts: dict[str, int] = {}
        for n in threads:
            w, t = split_threads(topo, n, worker_threads)
            counts[f"-t {n}: {_layout(w, t)}"] = n
            llms[f"-t {n}: {_layout(w, t)}"] = LLM(model, n_threads=n, worker_threads=worker_threads, **common)
        top = max(threads)
        if top > 1:  # the other way to use the cores: a rank per thread, or one rank of every thread
            other = (top, 1) if split_threads(topo, top, worker_threads)[1] > 1 else (1, top)
            counts[_layout(*other)] = top
            llms[_layout(*other)] = LLM(model, n_threads=top, worker_threads=other[1], **common)
        counts[f"in-process, {top} thread{'s' if top > 1 else ''}"] = top
        llms[f"in-process, {top} thread{'s' if top > 1 else ''}"] = LLM(model, n_threads=top, executor="inprocess", **common)
        for name in llms:
            results.append(ConfigResult(name, counts[name]))
        first = next(iter(llms.values()))
        ids = first.tokenize(PROMPT_TEXT * (1 + prompt_tokens // 20))[:prompt_tokens]
        for _ in range(rounds):
            for res, llm in zip(results, llms.values()):
                eng, ex = llm.engine, llm.engine.executor
                eng.rewind_all()
                t = time.perf_counter()
                token = int(np.argmax(eng.eval(ids)[-1]))
                res.prefill_tps.append(len(ids) / (time.perf_counter() - t))
                if isinstance(ex, NativePoolExecutor):
                    ex.reset_stats()
                t = time.perf_counter()
                for _ in range(gen_tokens):
                    token = int(np.argmax(eng.eval([token])[-1]))
                res.decode_tps.append(gen_tokens / (time.perf_counter() - t))
                if isinstance(ex, NativePoolExecutor):
                    lat = ex.merge_latencies_ns() / 1e3
                    res.merge_median_us, res.merge_p99_us = float(np.median(lat)), float(np.percentile(lat, 99))
                    res.wait_share = ex.stats.wait_share
                    res.syncs_per_step = ex.stats.syncs / max(1, ex.stats.calls)
                    res.rank_wait_shares = ex.stats.rank_wait_shares
                    res.outside_share = ex.stats.outside_share
        name = first.config.name
    finally:
        for llm in llms.values():
            llm.close()
    return ScalingResult(name, predictor, prompt_tokens, gen_tokens, rounds, results)


def plot_scaling(res: ScalingResult, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pools = [c for c in res.configs if c.name.startswith("-t ")]
    others = [c for c in res.configs if not c.name.startswith(("-t ", "in-process"))]
    ref = next(c for c in res.configs if c.name.startswith("in-process"))
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [c.threads for c in pools]
    ax.plot(xs, [statistics.median(c.decode_tps) for c in pools], "o-", label="default executor")
    for c in others:
        ax.plot([c.threads], [statistics.median(c.decode_tps)], "s", color="tab:orange", label=c.name)
    ax.axhline(statistics.median(ref.decode_tps), color="gray", linestyle="--", label=ref.name)
    ax.set_xlabel("CPU threads (-t)")
    ax.set_ylabel("decode tokens/s (median of alternating rounds)")
    ax.set_xticks(xs)
    ax.set_ylim(bottom=0)
    ax.set_title(f"{res.model}: thread scaling")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
