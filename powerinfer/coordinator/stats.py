"""Step statistics the executors keep, and what they say about them (``powerinfer --verbose``'s
per-layer figures, ``bench``'s JSON columns).

Runs in: the coordinator process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from powerinfer.cpu_workers.topology import Placement


@dataclass
class LayerTimings:
    """Accumulated microseconds: wall time of each round trip, and the slowest worker's compute."""

    calls: int = 0
    round_trip_us: float = 0.0
    compute_us: float = 0.0

    @property
    def ipc_us(self) -> float:
        return max(0.0, self.round_trip_us - self.compute_us)


@dataclass
class ExecutorStats:
    attention: LayerTimings = field(default_factory=LayerTimings)
    ffn: LayerTimings = field(default_factory=LayerTimings)
    head: LayerTimings = field(default_factory=LayerTimings)

    def reset(self) -> None:
        self.attention, self.ffn, self.head = LayerTimings(), LayerTimings(), LayerTimings()

    def figures(self) -> tuple[str, ...]:
        rows = ["per request (averaged over this run)   calls   round trip µs   worker compute µs   IPC µs"]
        for name, st in (("attention", self.attention), ("ffn", self.ffn), ("head", self.head)):
            if st.calls:
                rows.append(f"  {name:<36} {st.calls:6d} {st.round_trip_us / st.calls:15.1f} {st.compute_us / st.calls:19.1f} "
                            f"{st.ipc_us / st.calls:8.1f}")
        rows.append("  sparsity and GPU figures (hot-neuron ratio, predicted active share, transfer time): dense CPU run, none")
        return tuple(rows)

    def numbers(self) -> dict[str, float | list[float]]:
        """Per layer and decode step: one attention and one FFN round trip."""
        calls = max(1, self.attention.calls)
        return {"decode_layer_us": round((self.attention.round_trip_us + self.ffn.round_trip_us) / calls, 1),
                "decode_layer_compute_us": round((self.attention.compute_us + self.ffn.compute_us) / calls, 1),
                "decode_layer_ipc_us": round((self.attention.ipc_us + self.ffn.ipc_us) / calls, 1)}


@dataclass
class HybridStats:
    """Accumulated seconds: GPU attention round trips, CPU cold-neuron compute, waiting for the GPU's hot partial."""

    gpu_attention_s: float = 0.0
    cpu_attention_s: float = 0.0
    cpu_ffn_s: float = 0.0
    gpu_ffn_wait_s: float = 0.0  # time the GPU partial was still missing after the CPU finished
    gpu_layers_s: float = 0.0  # runs of whole GPU layers, one request each
    cpu_layers_s: float = 0.0  # runs of CPU-only layers in the native decoder
    native_layer_calls: int = 0  # layers computed there
    ffn_calls: int = 0  # split layers' FFN calls (hot on the GPU and/or cold here)
    attention_calls: int = 0  # split layers' attention calls (GPU or CPU)
    layer_runs: int = 0  # LAYERS requests
    whole_layer_calls: int = 0  # layers computed inside them

    @property
    def layer_calls(self) -> int:
        """Layers computed, any way (a forward pass of T tokens counts n_layers)."""
        return self.ffn_calls + self.whole_layer_calls + self.native_layer_calls

    def reset(self) -> None:
        for name, value in HybridStats().__dict__.items():
            setattr(self, name, value)

    def figures(self, hot_ratio: float, mass_on_gpu: float) -> tuple[str, ...]:
        n, na = max(1, self.ffn_calls), max(1, self.attention_calls)
        lines = [f"hot-neuron ratio {100 * hot_ratio:.1f}% ({100 * mass_on_gpu:.0f}% of the activation mass)"]
        if self.whole_layer_calls:
            lines.append(f"  layers wholly on the GPU: {self.gpu_layers_s / self.whole_layer_calls * 1e6:10.1f} µs per layer "
                         f"({self.layer_runs} requests for {self.whole_layer_calls} layer calls)")
        if self.native_layer_calls:
            lines.append(f"  layers with no GPU part (native decoder): {self.cpu_layers_s / self.native_layer_calls * 1e6:10.1f} µs per layer "
                         f"({self.native_layer_calls} layer calls)")
        if self.ffn_calls:
            lines += [
                f"  split layers, per FFN call (n={self.ffn_calls}): CPU cold neurons {self.cpu_ffn_s / n * 1e6:10.1f} µs   "
                f"waiting for the GPU's hot partial {self.gpu_ffn_wait_s / n * 1e6:10.1f} µs",
                f"  split layers' attention (n={self.attention_calls}): GPU {self.gpu_attention_s / na * 1e6:10.1f} µs, "
                f"CPU {self.cpu_attention_s / na * 1e6:10.1f} µs per call",
            ]
        return tuple(lines)


@dataclass
class PoolStats:
    """Accumulated over calls: wall time of each call, the ranks' time in native code and, of it,
    waiting in merges (summed over ranks, and per rank), and the merges themselves."""

    calls: int = 0
    round_trip_us: float = 0.0
    compute_us: float = 0.0  # summed over ranks
    wait_us: float = 0.0  # summed over ranks
    syncs: int = 0  # per rank
    rank_compute_us: list[float] = field(default_factory=list)
    rank_wait_us: list[float] = field(default_factory=list)
    slowest_us: float = 0.0  # per call, the rank longest in native code: the rest of the wall time is outside it
    gpu_us: float = 0.0  # per call, the longest a CPU rank waited for the GPU rank's answers (runs of layers, attention, hot neurons)

    def reset(self) -> None:
        self.calls, self.round_trip_us, self.compute_us, self.wait_us, self.syncs = 0, 0.0, 0.0, 0.0, 0
        self.rank_compute_us, self.rank_wait_us, self.slowest_us, self.gpu_us = [], [], 0.0, 0.0

    @property
    def wait_share(self) -> float:
        """Share of the ranks' native time spent waiting for peers in the merges."""
        return self.wait_us / self.compute_us if self.compute_us else 0.0

    @property
    def rank_wait_shares(self) -> list[float]:
        """Per rank: its share of native time spent waiting. One rank always waiting for another is
        an imbalance of work; all ranks waiting a little is jitter."""
        return [w / c if c else 0.0 for w, c in zip(self.rank_wait_us, self.rank_compute_us)]

    @property
    def outside_share(self) -> float:
        """Share of the calls' wall time outside the slowest rank's native code: the doorbell's round
        trip, the coordinator's own work, the ranks' return to and from the step loop."""
        return 1.0 - self.slowest_us / self.round_trip_us if self.round_trip_us else 0.0

    def add(self, wall_us: float, compute_us: Sequence[float], wait_us: Sequence[float], syncs: int, gpu_us: float = 0.0) -> None:
        """One call: its wall time, and per rank the time in native code and of it in merges; the
        longest wait for the GPU rank."""
        if len(self.rank_compute_us) != len(compute_us):
            self.rank_compute_us, self.rank_wait_us = [0.0] * len(compute_us), [0.0] * len(compute_us)
        self.calls += 1
        self.round_trip_us += wall_us
        self.compute_us += sum(compute_us)
        self.wait_us += sum(wait_us)
        self.syncs += syncs
        self.slowest_us += max(compute_us, default=0.0)
        self.gpu_us += gpu_us
        for i, (c, w) in enumerate(zip(compute_us, wait_us)):
            self.rank_compute_us[i] += c
            self.rank_wait_us[i] += w

    def figures(self, ranks: int, merge_ns: np.ndarray) -> tuple[str, ...]:
        """ranks: CPU ranks; merge_ns: their latest merge latencies."""
        n = max(1, self.calls)
        lat = merge_ns / 1e3
        med = f"{float(np.median(lat)):.1f}" if lat.size else "-"
        p99 = f"{float(np.percentile(lat, 99)):.1f}" if lat.size else "-"
        gpu = [f"waiting for the GPU rank (its runs of layers, attention and hot neurons, beyond the CPU ranks' own work): "
               f"{self.gpu_us / n:.1f} µs a step"] * bool(self.gpu_us)
        return (f"per step (n={self.calls}): round trip {self.round_trip_us / n:.1f} µs, a rank's native time {self.compute_us / n / ranks:.1f} µs, "
                f"of it {100 * self.wait_share:.1f}% waiting in merges ({self.syncs / n:.0f} merges a step)",
                f"merge latency per sync: median {med} µs, p99 {p99} µs", *gpu)

    def numbers(self, merge_ns: np.ndarray) -> dict[str, float | list[float]]:
        """One step per token, four merges per layer."""
        lat = merge_ns / 1e3
        return {"decode_step_us": round(self.round_trip_us / max(1, self.calls), 1),
                "merge_median_us": round(float(np.median(lat)), 2) if lat.size else 0.0,
                "merge_p99_us": round(float(np.percentile(lat, 99)), 2) if lat.size else 0.0,
                "merge_wait_share": round(self.wait_share, 3), "merge_wait_share_per_rank": [round(w, 3) for w in self.rank_wait_shares],
                "outside_native_share": round(self.outside_share, 3)}


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def pinning_text(placements: Sequence[Placement]) -> str:
    """Where each worker is pinned: "w0: node 0 cpus 0,1, ..." (or "not pinned")."""
    return ", ".join(f"w{p.worker}: node {p.node} cpus {','.join(map(str, p.cpus))}" for p in placements) or "not pinned"


def layer_runs_text(layers: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> "0-2, 5"."""
    out: list[str] = []
    for i in layers:
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)
