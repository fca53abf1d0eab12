"""The one place an executor is chosen: from the user's options, the model and this machine.

Runs in: the coordinator process.

The order, and why (logged at INFO, so ``--verbose`` says which one runs and why):

1. a GPU worker that cannot be a rank of the native pool (in process, the in-process executor, or
   ``--transport zmq``): the hybrid executor, its cold neurons here;
2. ``inprocess``: the native decoder in this process where it can run the model, else the torch
   shards (the test oracle; ``native=False`` asks for them);
3. ``process`` (the default): native worker ranks merging in shared memory (a GPU worker joins as
   one more rank); where the native decoder cannot run the model, torch shards in worker processes
   over ZeroMQ (or the hybrid executor when a GPU worker is asked for).
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from powerinfer.config import ModelConfig
from powerinfer.coordinator.executor import Executor
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.predictors.predictor_types import refuse_residual_input

if TYPE_CHECKING:
    from powerinfer.coordinator.cluster.options import ClusterOptions
    from powerinfer.coordinator.hybrid_executor import GpuOptions
    from powerinfer.predictors.predictor_file import PredictorFile

log = logging.getLogger(__name__)

KINDS = ("process", "inprocess")
TRANSPORTS = ("auto", "shm", "zmq")


@dataclass(frozen=True)
class ExecutorOptions:
    """What the user asked for (LLM's keyword arguments, the CLI's flags)."""

    kind: str = "process"  # "process": worker processes (the default); "inprocess": this process
    n_ctx: int = 4096
    n_batch: int = 512  # most tokens per forward pass
    n_threads: Optional[int] = None  # CPU threads, in worker processes or in this process; None: one per physical core
    worker_threads: Optional[int] = None  # threads per worker process; None: one per node and L3 (split_threads)
    n_shards: int = 1  # inprocess torch: shards per layer, as workers would split it
    pin: bool = True  # pin worker processes to cores and NUMA nodes
    progress: bool = False
    n_slots: int = 1  # KV-cache slots (concurrent sequences)
    gpu: Optional["GpuOptions"] = None
    native: Optional[bool] = None  # inprocess: True requires the native decoder, False refuses it, None where it can
    transport: str = "auto"  # process: "shm" native ranks, "zmq" torch shards over ZeroMQ, "auto" the first that runs
    cluster: Optional["ClusterOptions"] = None  # a pipeline of stages on Ray nodes (--ray-address, --pipeline-stages)

    def check(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgumentError(f"executor must be 'process' or 'inprocess', got {self.kind!r}")
        if self.transport not in TRANSPORTS:
            raise InvalidArgumentError(f"transport must be 'auto', 'shm' or 'zmq', got {self.transport!r}")
        if self.n_threads is not None and self.n_threads < 1:
            raise InvalidArgumentError(f"threads must be >= 1, got {self.n_threads}")
        if self.worker_threads is not None and self.worker_threads < 1:
            raise InvalidArgumentError(f"threads per worker process must be >= 1, got {self.worker_threads}")
        if self.cluster is not None:
            self.cluster.check()


@dataclass(frozen=True)
class Model:
    """The loaded model an executor is built for: its file, config and (validated) predictor."""

    path: Path
    file: GGUFFile
    config: ModelConfig
    predictor: Optional["PredictorFile"]  # loaded and checked against the model, used only when sparse
    predictor_path: Optional["str | os.PathLike[str]"]
    sparse: bool


def build_executor(m: Model, o: ExecutorOptions) -> Executor:
    o.check()
    if o.cluster is not None:
        return _pipeline(m, o, o.cluster)
    gpu = o.gpu
    if gpu is not None and (not gpu.process or o.kind != "process" or o.transport == "zmq"):
        log.info("executor: hybrid (a GPU worker %s; its cold neurons in this process)",
                 "in this process" if not gpu.process else "that cannot be a rank of the native pool here")
        return _hybrid(m, o)
    use = m.predictor if m.sparse else None
    if o.kind == "inprocess":
        lib = _native_lib(m, o.native, o.n_shards == 1)
        if lib is not None:
            from powerinfer.coordinator.native_executor import NativeExecutor
            from powerinfer.cpu_workers.topology import default_workers

            log.info("executor: the native decoder in this process (--executor inprocess)")
            return NativeExecutor(lib, m.file, m.config, o.n_ctx, o.n_threads or default_workers(), n_slots=o.n_slots,
                                  max_tokens=o.n_batch, predictor=use)
        from powerinfer.coordinator.inprocess import InProcessExecutor

        if o.n_threads is not None:
            import torch

            torch.set_num_threads(o.n_threads)
        log.info("executor: torch shards in this process (--executor inprocess, the native decoder not used)")
        return InProcessExecutor(m.file, m.config, o.n_ctx, n_shards=o.n_shards, progress=o.progress, predictor=use, n_slots=o.n_slots)
    return _worker_processes(m, o)


def _pipeline(m: Model, o: ExecutorOptions, c: "ClusterOptions") -> Executor:
    """The layers in stages on Ray nodes (Ray is imported only here, and only with the flags)."""
    from powerinfer.coordinator.cluster.pipeline import PipelineExecutor, pipeline_refusal

    why = pipeline_refusal(o.gpu is not None)
    if why is not None:
        raise InvalidArgumentError(why)
    sparse = m.sparse and m.predictor is not None
    log.info("executor: a pipeline of %d stages on the Ray cluster at %s (%s)%s", c.stages, c.address, c.placement,
             ", sparse FFNs" if sparse else "")
    return PipelineExecutor(str(m.path), m.file, m.config, o.n_ctx, o.n_slots, o.n_batch, c,
                            predictor=str(Path(m.predictor_path).resolve()) if sparse and m.predictor_path is not None else "")


def _hybrid(m: Model, o: ExecutorOptions) -> Executor:
    """Hot neurons (and the attention of offloaded layers) on the GPU worker, cold ones in this process."""
    from powerinfer.coordinator.hybrid_executor import build_hybrid_executor

    assert o.gpu is not None
    if o.n_threads is not None:
        import torch

        torch.set_num_threads(o.n_threads)
    return build_hybrid_executor(m.path, m.file, m.config, o.n_ctx, o.gpu, predictor=m.predictor, predictor_path=_path(m),
                                 sparse=m.sparse, n_slots=o.n_slots, progress=o.progress, log_level=_log_level())


def _path(m: Model) -> Path | None:
    return None if m.predictor_path is None else Path(m.predictor_path)


def _log_level() -> str:
    return logging.getLevelName(logging.getLogger().getEffectiveLevel())


def _worker_processes(m: Model, o: ExecutorOptions) -> Executor:
    """Worker processes: native ranks merging in shared memory (and a GPU rank with -ngl), or torch shards over ZeroMQ."""
    from powerinfer.coordinator.native_pool import shm_blocker
    from powerinfer.cpu_workers.topology import default_workers, plan_placement, read_topology, split_threads

    sparse = m.sparse and m.predictor is not None
    topo = read_topology()
    n_workers, worker_threads = split_threads(topo, o.n_threads or default_workers(topo), o.worker_threads)
    if o.transport != "zmq":
        why = shm_blocker(m.file, m.config, n_workers, sparse)
        if why is None:
            from powerinfer.coordinator.gpu_rank import gpu_rank_spec
            from powerinfer.coordinator.native_pool import NativePoolExecutor
            from powerinfer.native.decoder_lib import decoder_lib

            rank = None if o.gpu is None else gpu_rank_spec(m.path, m.file, m.config, o.n_ctx, o.gpu, predictor=m.predictor,
                                                             predictor_path=_path(m), sparse=sparse, n_slots=o.n_slots,
                                                             log_level=_log_level())
            placements = tuple(plan_placement(topo, n_workers, worker_threads)) if o.pin else ()
            lib = decoder_lib()
            assert lib is not None  # shm_blocker said it loads
            log.info("executor: %d native worker rank%s of %d thread%s%s%s", n_workers, "s" if n_workers > 1 else "", worker_threads,
                     "s" if worker_threads > 1 else "", " merging in shared memory" if n_workers > 1 or rank is not None else "",
                     " and a GPU rank" if rank is not None else "")
            return NativePoolExecutor(lib, m.file, str(m.path), m.config, o.n_ctx, n_workers, worker_threads, placements, _log_level(),
                                      o.n_slots, o.n_batch, predictor=str(m.predictor_path) if sparse else "", gpu=rank)
        if o.transport == "shm":
            raise InvalidArgumentError(f"--transport shm is not possible here: {why}")
        if o.gpu is not None:  # the GPU rank needs native CPU ranks: the hybrid executor instead
            log.warning("the GPU worker cannot join native worker ranks (%s): hybrid executor", why)
            return _hybrid(m, o)
        log.warning("worker processes exchange each layer over ZeroMQ (slower): %s", why)
    from powerinfer.coordinator.process_executor import ProcessExecutor

    refuse_residual_input(m.predictor if m.sparse else None, "the ZeroMQ torch workers")
    log.info("executor: %d torch worker process%s of %d thread%s over ZeroMQ", n_workers, "es" if n_workers > 1 else "", worker_threads,
             "s" if worker_threads > 1 else "")
    # the coordinator only does small numpy work (norms, residuals, sampling): the workers hold every matrix
    return ProcessExecutor(m.file, m.config, o.n_ctx, n_workers, threads_per_worker=worker_threads, pin=o.pin,
                           predictor=str(m.predictor_path) if sparse else "", log_level=_log_level(), n_slots=o.n_slots)


def _native_lib(m: Model, native: bool | None, applies: bool) -> ctypes.CDLL | None:
    """The native decoder library when the in-process executor should use it, else None (and why, logged)."""
    if native is False:
        return None
    if not applies:
        if native:
            raise InvalidArgumentError("the native decoder runs models in one shard: n_shards=1")
        return None
    from powerinfer.native.decoder_lib import decoder_lib
    from powerinfer.native.decoder import supports

    lib = decoder_lib()
    if lib is None:  # decoder_lib has said why when a build failed; POWERINFER_NATIVE=0 is said here
        if native:
            raise InvalidArgumentError("the native decoder is unavailable (POWERINFER_NATIVE=0, or no C compiler: see the log)")
        if os.environ.get("POWERINFER_NATIVE", "1") == "0":
            log.warning("POWERINFER_NATIVE=0: the in-process executor runs on torch (slower)")
        return None
    why = supports(m.file, m.config)
    if why is None:
        return lib
    if native:
        raise InvalidArgumentError(f"the native decoder cannot run this model: {why}")
    log.warning("the native decoder cannot run this model (%s): the in-process executor runs on torch", why)
    return None
