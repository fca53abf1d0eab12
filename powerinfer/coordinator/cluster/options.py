"""What the user asked of a cluster (``--ray-address``, ``--pipeline-stages``, ``--replicas``, ``--ray-placement``).

Runs in: the coordinator (no Ray needed to hold or check these).
"""

from __future__ import annotations

from dataclasses import dataclass

from powerinfer.errors import InvalidArgumentError

PLACEMENTS = {"spread": "STRICT_SPREAD", "pack": "PACK"}  # one stage per node; or as few nodes as fit (one host's test)


@dataclass(frozen=True)
class ClusterOptions:
    address: str = "auto"  # Ray's address: "auto" (a cluster this host joined with `ray start`), "host:port", "ray://..."
    stages: int = 2  # pipeline stages, one per node
    replicas: int = 1  # full copies of the model, each with its own stages; the engine's slots alternate over them
    placement: str = "spread"  # "spread" (Ray's STRICT_SPREAD) or "pack" (PACK)
    # per stage: CPU threads of its native pool (a rank per NUMA node and L3) or, inprocess, of its decoder;
    # default: the node's physical cores
    threads: int | None = None
    inprocess: bool = False  # each stage runs the native decoder in its actor's process, not a native pool of ranks
    pin: bool = True  # a stage pool's ranks pinned to cores and NUMA nodes
    place_timeout_s: float = 60.0  # how long placing the stages may wait for nodes (a restart after a node is lost included)

    def check(self) -> None:
        if self.stages < 1:
            raise InvalidArgumentError(f"--pipeline-stages must be >= 1, got {self.stages}")
        if self.replicas < 1:
            raise InvalidArgumentError(f"--replicas must be >= 1, got {self.replicas}")
        if self.placement not in PLACEMENTS:
            raise InvalidArgumentError(f"--ray-placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if self.threads is not None and self.threads < 1:
            raise InvalidArgumentError(f"threads per stage must be >= 1, got {self.threads}")
