"""Which layers each pipeline stage holds: contiguous ranges sized by the nodes' memory.

Runs in: the coordinator (before any stage is placed; no Ray needed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from powerinfer.config import ModelConfig
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile

_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class StageRange:
    """Layers [first, stop) of one stage and the bytes of weights it maps (embedding or head included)."""

    index: int
    first: int
    stop: int
    weight_bytes: int

    @property
    def layers(self) -> frozenset[int]:
        return frozenset(range(self.first, self.stop))


def layer_bytes(f: GGUFFile, cfg: ModelConfig) -> tuple[list[int], int, int]:
    """(bytes of each layer's tensors [n_layers], the embedding's, the head's and final norm's)."""
    per = [0] * cfg.n_layers
    embd = head = 0
    for t in f:
        m = _LAYER.match(t.name)
        if m:
            per[int(m.group(1))] += t.nbytes
        elif t.name.startswith(("token_embd", "position_embd")):
            embd += t.nbytes
        else:
            head += t.nbytes
    if "output.weight" not in f.tensors:  # a tied head reads the embedding's rows on the last stage too
        head += f.tensor("token_embd.weight").nbytes
    return per, embd, head


def split_layers(per_layer: list[int], embd: int, head: int, memory: list[int]) -> list[StageRange]:
    """Split the layers into len(memory) contiguous ranges, the first with the embedding and the
    last with the head, each stage's share of the layers' bytes as its node's share of the memory
    (the layers are the work of every token; a large vocabulary's embedding and head would
    otherwise leave the end stages a layer each: Gemma-3-270M's are 3x its 18 layers).

    memory [stages]: bytes each stage's node offers, in stage order. Every stage gets one layer at
    least; InvalidArgumentError when there are more stages than layers or a stage's share does not
    fit its node."""
    n, stages = len(per_layer), len(memory)
    if stages < 1:
        raise InvalidArgumentError("a pipeline needs one stage at least")
    if stages > n:
        raise InvalidArgumentError(f"{stages} pipeline stages for a model of {n} layers: at most one stage per layer")
    total = sum(per_layer)
    bounds, acc = [0], 0.0
    cum = [0]
    for b in per_layer:
        cum.append(cum[-1] + b)
    for s in range(stages - 1):
        acc += memory[s] / sum(memory)
        target = acc * total  # the layer bytes the first s + 1 stages should hold
        # the cut nearest the target, leaving one layer at least to each stage on either side
        lo, hi = bounds[-1] + 1, n - (stages - 1 - s)
        cut = min(range(lo, hi + 1), key=lambda c: abs(cum[c] - target))
        bounds.append(cut)
    bounds.append(n)
    out = []
    for s in range(stages):
        a, b = bounds[s], bounds[s + 1]
        w = cum[b] - cum[a] + (embd if s == 0 else 0) + (head if s == stages - 1 else 0)
        if w > memory[s]:
            raise InvalidArgumentError(f"pipeline stage {s} holds layers {a}..{b - 1} ({w / 2**30:.2f} GiB of weights), more than its node's "
                                       f"{memory[s] / 2**30:.2f} GiB: add stages or nodes with more memory")
        out.append(StageRange(s, a, b, w))
    return out
