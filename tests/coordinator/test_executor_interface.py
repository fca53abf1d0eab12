"""Every executor through the one Executor interface (coordinator/executor.py), the same tests for all:
built by the factory (coordinator/factory.py) from the options a user gives, each answers every Want
like the torch in-process oracle, describes itself, saves and restores a slot or refuses by name,
survives restart() and closes.

Runs in: the pytest process (the pool and ZeroMQ cases start worker processes; the GPU cases use the
CPU backend, in process or as a worker process joining the pool).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.config import config_from_gguf
from powerinfer.coordinator.executor import Batch, Description, Executor, Want
from powerinfer.coordinator.factory import ExecutorOptions, Model, build_executor
from powerinfer.coordinator.hybrid_executor import GpuOptions
from powerinfer.coordinator.inprocess import InProcessExecutor
from powerinfer.coordinator.logits import REFINE
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.gpu_worker.errors import GIB
from powerinfer.sparsity.profile import ProfilingExecutor

IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108]
CTX = 64
GPU = dict(backend="cpu", split="layer", vram_budget_gib=64 * 2**20 / GIB, max_tokens=8)

# name -> (ExecutorOptions fields, worker processes it starts, the logits' tolerance against the torch oracle)
CASES: dict[str, tuple[dict[str, object], int, float]] = {
    "native in process": (dict(kind="inprocess", n_threads=1), 0, 0.05),
    "torch in process": (dict(kind="inprocess", native=False), 0, 0.0),
    "native pool": (dict(kind="process", n_threads=2, worker_threads=1, pin=False), 2, 0.05),
    "torch workers over ZeroMQ": (dict(kind="process", n_threads=2, worker_threads=1, pin=False, transport="zmq"), 2, 0.01),  # two shards: bf16 head rounding
    "hybrid, GPU in process": (dict(kind="inprocess", gpu=GpuOptions(process=False, **GPU)), 0, 0.05),  # type: ignore[arg-type]
    "pool with a GPU rank": (dict(kind="process", n_threads=2, worker_threads=1, pin=False, gpu=GpuOptions(process=True, **GPU)), 3, 0.05),  # type: ignore[arg-type]
    "profiling": ({}, 0, 0.0),
    "Ray pipeline": ({}, 0, 0.05),  # two stages packed on a local Ray node (skipped without Ray)
}


def _build(path: Path, case: str) -> Executor:
    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    if case == "profiling":
        return ProfilingExecutor(f, cfg, CTX)
    if case == "Ray pipeline":
        from powerinfer.coordinator.cluster.options import ClusterOptions

        ray = pytest.importorskip("ray", reason="Ray is the [ray] extra")
        if not ray.is_initialized():  # one local node for the module's cases; ended with the session
            ray.init(num_cpus=2, object_store_memory=80 << 20, log_to_driver=False, configure_logging=False, include_dashboard=False)
        opts = ClusterOptions(address="local", stages=2, placement="pack", threads=1)
        return build_executor(Model(path, f, cfg, None, None, True), ExecutorOptions(n_ctx=CTX, n_batch=16, cluster=opts))
    fields, _, _ = CASES[case]
    return build_executor(Model(path, f, cfg, None, None, True), ExecutorOptions(n_ctx=CTX, n_batch=16, **fields))  # type: ignore[arg-type]


def _oracle_logits(path: Path) -> np.ndarray:
    f = GGUFFile(path)
    ex = InProcessExecutor(f, config_from_gguf(f), CTX)
    try:
        return ex.execute(_batch(IDS, 0, Want.ALL))
    finally:
        ex.close()


def _batch(ids: list[int], start: int, want: Want, slot: int = 0) -> Batch:
    n = len(ids)
    return Batch(np.array(ids, dtype=np.int64), np.arange(start, start + n, dtype=np.int64), np.full(n, slot, dtype=np.int64), want)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from powerinfer.synthetic import SyntheticSpec, write_synthetic_gguf

    return write_synthetic_gguf(tmp_path_factory.mktemp("iface") / "llama.gguf", SyntheticSpec(arch="llama", qtype=QT.Q8_0))


@pytest.fixture(scope="module", autouse=True)
def _local_ray() -> Iterator[None]:
    """The Ray pipeline case's local node, shut down with the module (other modules start their own clusters)."""
    yield
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(params=list(CASES))
def executor(request: pytest.FixtureRequest, model: Path) -> Iterator[tuple[str, Executor]]:
    ex = _build(model, request.param)
    try:
        yield request.param, ex
    finally:
        ex.close()


def _close(a: np.ndarray, b: np.ndarray, tol: float) -> None:
    span = float(b.max() - b.min())
    assert float(np.abs(a - b).max()) <= tol * span, f"max diff {np.abs(a - b).max():.3g} of a range {span:.3g}"


def test_every_want_answers_like_the_oracle(executor: tuple[str, Executor], model: Path) -> None:
    case, ex = executor
    tol = CASES[case][2]
    want = _oracle_logits(model)  # [T, V]
    T, V = want.shape
    got = ex.execute(_batch(IDS, 0, Want.ALL))
    assert got.shape == (T, V) and got.dtype == np.float32
    _close(got, want, tol)
    ex.restart()  # fresh KV caches for the next passes (no-op without workers: positions are rewritten)
    # a prompt in two chunks: the first only fills the cache, the last answers for its last token
    assert ex.execute(_batch(IDS[:5], 0, Want.CACHE)).size == 0
    last = ex.execute(_batch(IDS[5:], 5, Want.LAST))
    assert last.shape == (1, V)
    # the decode rule refines the candidates near the best, ALL the best REFINE: the rest are the
    # packed head's (bf16-rounded) values, so the same argmax and best value, the rest to 1% of the range
    _close(last, want[-1:], max(tol, 0.01))
    assert last[0].argmax() == want[-1].argmax() and abs(last[0].max() - want[-1].max()) <= 1e-3 + tol
    # decode steps of two sequences in one pass (slots 0 and 1 are independent)
    each = ex.execute(_batch(IDS[:1], 0, Want.EACH, slot=0))
    assert each.shape == (1, V)
    _close(each, want[:1], max(tol, 0.01))
    assert each[0].argmax() == want[0].argmax()
    hidden = ex.execute(_batch(IDS[:3], 0, Want.HIDDEN))
    assert hidden.shape == (3, config_from_gguf(GGUFFile(model)).d_model) and np.isfinite(hidden).all()


def test_refined_logits_are_the_head_rows_in_float32(executor: tuple[str, Executor], model: Path) -> None:
    """The best REFINE candidates of a row are exact float32 products of the hidden state and the
    head rows, whichever executor computed them (coordinator/logits.py's one rule)."""
    from powerinfer.model.weights import embed_rows

    _, ex = executor
    f = GGUFFile(model)
    cfg = config_from_gguf(f)
    hidden = ex.execute(_batch(IDS, 0, Want.HIDDEN))
    ex.restart()
    logits = ex.execute(_batch(IDS, 0, Want.ALL))
    best = np.argsort(-logits[-1])[: min(4, REFINE)]
    head = embed_rows(f, best, "token_embd.weight" if cfg.tied_embeddings else "output.weight")
    np.testing.assert_allclose(logits[-1, best], hidden[-1] @ head.T, rtol=2e-5, atol=2e-4)


def test_describe_health_stats_and_sparse_switches(executor: tuple[str, Executor], model: Path) -> None:
    case, ex = executor
    ex.execute(_batch(IDS, 0, Want.LAST))
    d = ex.describe()
    assert isinstance(d, Description) and d.kind and d.placement and all(isinstance(line, str) for line in d.figures)
    assert len(d.pids) == CASES[case][1]
    assert ex.weight_bytes > 0
    ex.check_health()
    ex.reset_stats()
    ex.set_sparse(dense=False, oracle=False)  # dense executors: nothing to switch, and no error


def test_slot_save_and_restore_or_a_clear_refusal(executor: tuple[str, Executor], model: Path, tmp_path: Path) -> None:
    from powerinfer.coordinator.engine import Engine
    from powerinfer.coordinator.slots import restore_slot, save_slot

    _, ex = executor
    f = GGUFFile(model)
    eng = Engine(f, config_from_gguf(f), ex, CTX, 16)
    first = eng.eval(IDS)
    path = str(tmp_path / "slot.bin")
    if ex.describe().kv_layout is None:
        with pytest.raises(InvalidArgumentError, match="cannot reach"):
            save_slot(eng, 0, path)
        return
    try:
        save_slot(eng, 0, path)
    except InvalidArgumentError as e:  # the pool with a GPU rank: its layers' cache lives on the device
        assert "GPU" in str(e)
        return
    eng.rewind_all()
    ex.restart()
    restore_slot(eng, 0, path)
    nxt = int(np.argmax(first[-1]))
    again = eng.eval([nxt])
    eng.rewind_all()
    eng.eval(IDS)
    np.testing.assert_array_equal(again, eng.eval([nxt]))
