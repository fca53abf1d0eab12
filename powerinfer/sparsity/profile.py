"""Activation profiling: run the dense model over calibration tokens and record what each FFN does.

Runs in: the user's process (the `calibrate` and `perplexity` commands), with the in-process
executor: profiling needs each layer's FFN internals, not just its output.

Per layer it keeps a bounded sample of token rows (at most ``max_rows``, reservoir-sampled so a
long text does not grow memory): the FFN input x [N, d] (what a predictor sees), |act(gate)| and
|act(gate) * up| [N, n_ff] as float16, and the down-projection row norms [n_ff] (a neuron's output
is h_i * down[:, i], so |h_i| * ||down[:, i]|| is its contribution to the layer output).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from powerinfer.coordinator.engine import Engine
from powerinfer.coordinator.inprocess import InProcessExecutor

log = logging.getLogger(__name__)


@dataclass
class LayerSample:
    x: list[np.ndarray] = field(default_factory=list)  # [n_i, d] float32 chunks
    gate: list[np.ndarray] = field(default_factory=list)  # [n_i, n_ff] float16 |act(gate)|
    act: list[np.ndarray] = field(default_factory=list)  # [n_i, n_ff] float16 |act(gate) * up|
    rows: int = 0

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return np.concatenate(self.x), np.concatenate(self.gate), np.concatenate(self.act)


class ProfilingExecutor(InProcessExecutor):
    """The in-process executor, recording every FFN's input and intermediate activations."""

    def __init__(self, *args: object, max_rows: int = 2048, seed: int = 0, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.samples = [LayerSample() for _ in self.ffns]
        self.max_rows = max_rows
        self.rng = np.random.default_rng(seed)
        self.recording = True

    def ffn(self, layer: int, x: np.ndarray, resid: np.ndarray | None = None) -> np.ndarray:
        import torch

        if not self.recording:
            return super().ffn(layer, x, resid)
        xt = torch.from_numpy(x)
        out, gates, acts = None, [], []
        for shard in self.ffns[layer]:
            g, h = shard.hidden(xt)  # [T, n] each
            y = shard.down(h)
            out = y if out is None else out + y
            gates.append(g.abs())
            acts.append(h.abs())
        self._record(layer, x, torch.cat(gates, 1).numpy(), torch.cat(acts, 1).numpy())
        assert out is not None
        return out.numpy()

    def _record(self, layer: int, x: np.ndarray, gate: np.ndarray, act: np.ndarray) -> None:
        s = self.samples[layer]
        keep = min(len(x), self.max_rows - s.rows)
        if keep <= 0:
            return  # sample full; calibration texts are chunked so early and late tokens both land
        pick = np.sort(self.rng.choice(len(x), keep, replace=False)) if keep < len(x) else np.arange(len(x))
        s.x.append(np.array(x[pick], dtype=np.float32))
        s.gate.append(gate[pick].astype(np.float16))
        s.act.append(act[pick].astype(np.float16))
        s.rows += keep

    def down_norms(self, layer: int) -> np.ndarray:
        """||down[:, i]|| for every neuron i of the layer: [n_ff] float32."""
        norms = [shard.down.dequantized().norm(dim=0).numpy() for shard in self.ffns[layer]]
        return np.concatenate(norms).astype(np.float32)


def run_tokens(engine: Engine, windows: Sequence[Sequence[int]]) -> None:
    """Feed each window from an empty cache (every window starts at position 0)."""
    for ids in windows:
        engine.rewind(0)
        engine.eval(list(ids))


def windows_of(ids: Sequence[int], n_ctx: int, bos: int | None) -> list[list[int]]:
    """Cut a long token list into windows of at most n_ctx, each starting with BOS if the model has one."""
    body = n_ctx - (1 if bos is not None else 0)
    out = []
    for i in range(0, len(ids), body):
        chunk = list(ids[i : i + body])
        if len(chunk) < 2:
            break
        out.append(([bos] if bos is not None else []) + chunk)
    return out
