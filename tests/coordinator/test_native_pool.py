"""The native pool (transport "shm"): ranks equal the unsplit native decoder bit for bit, the merge
moves the right numbers, a rank that dies or stops inside a merge fails the step without a hang,
and an idle pool sleeps."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import psutil
import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.api import LLM
from powerinfer.config import ModelConfig, config_from_gguf
from powerinfer.coordinator.native_pool import NativePoolExecutor
from powerinfer.coordinator.process_executor import ProcessExecutor
from powerinfer.native.decoder_lib import decoder_lib
from powerinfer.native.decoder import NativeDecoder
from powerinfer.native.comm import RankComm, create_segment
from powerinfer.native.segment import SegmentLayout
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.sharding import plan_ranks
from powerinfer.protocol import WorkerDiedError
from tests.coordinator.helpers import gone

IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]
lib = decoder_lib()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: the native pool is unavailable")


def _ranks_in_threads(path: Path, n: int, x: np.ndarray, pos: np.ndarray, slots: np.ndarray, n_slots: int = 1) -> list[np.ndarray]:
    """n ranks of the model, each in a thread of this process, sharing one segment: their hidden states."""
    assert lib is not None
    cfg = config_from_gguf(GGUFFile(path))
    seg = create_segment(lib, cfg, n, 16)
    decs, comms = [], []
    for r, sh in enumerate(plan_ranks(cfg, n)):
        d = NativeDecoder(lib, GGUFFile(path), cfg, 32, n_slots, 1, 16, sh)
        comms.append(RankComm(lib, seg, r))
        d.model.comm = comms[-1].ptr
        decs.append(d)
    outs: list[np.ndarray] = [np.empty(0)] * n

    def run(r: int) -> None:
        outs[r] = decs[r].forward(x.copy(), pos, slots).copy()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(c.comm.n_syncs == 4 * cfg.n_layers for c in comms)  # four gathers a layer
    seg.close()
    return outs


@pytest.mark.parametrize("arch,qtype", [("llama", QT.Q4_0), ("llama", QT.Q5_0), ("qwen2", QT.Q8_0), ("gemma3", QT.Q4_1), ("gemma3", QT.F16)])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ranks_equal_unsplit_decoder_bit_for_bit(make_model: Callable[..., Path], arch: str, qtype: QT, n: int) -> None:
    # 4 query heads over 2 kv heads: 3 ranks split a group (its kv head computed by two ranks)
    path = make_model(arch=arch, qtype=qtype, n_layers=2, d_model=256, n_ff=512, n_heads=4, n_kv_heads=2, head_dim=64)
    assert lib is not None
    cfg = config_from_gguf(GGUFFile(path))
    rng = np.random.default_rng(n)
    for x, pos, slots in ((rng.standard_normal((5, cfg.d_model)).astype(np.float32), np.arange(5), np.zeros(5, np.int64)),
                          (rng.standard_normal((2, cfg.d_model)).astype(np.float32), np.array([0, 0]), np.array([0, 1]))):
        pos, slots = pos.astype(np.int64), slots.astype(np.int64)
        want = NativeDecoder(lib, GGUFFile(path), cfg, 32, 2, 1, 16).forward(x.copy(), pos, slots)
        for got in _ranks_in_threads(path, n, x, pos, slots, n_slots=2):
            np.testing.assert_array_equal(got, want)


def _cfg(make_model: Callable[..., Path], **over: object) -> ModelConfig:
    return replace(config_from_gguf(GGUFFile(make_model(arch="llama"))), **over)  # type: ignore[arg-type]


def test_plan_ranks_covers_every_part_once(make_model: Callable[..., Path]) -> None:
    cfg = _cfg(make_model, vocab_size=1001, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64, v_head_dim=64, n_ff=1536)
    for n in (1, 2, 3, 4, 9):
        ranks = plan_ranks(cfg, n)
        assert [r.q0 for r in ranks] + [cfg.n_heads] == [0] + [r.q1 for r in ranks]
        assert sum(r.n1 - r.n0 for r in ranks) == cfg.n_ff and sum(r.d1 - r.d0 for r in ranks) == cfg.d_model
        assert sum(r.v1 - r.v0 for r in ranks) == cfg.vocab_size
        assert all(r.kv0 == r.q0 // 3 and r.kv1 == (r.q1 - 1) // 3 + 1 for r in ranks)
    with pytest.raises(InvalidArgumentError, match="query head"):
        plan_ranks(cfg, 10)


def test_segment_layout_mirrors_the_native_offsets(make_model: Callable[..., Path]) -> None:
    """The coordinator sizes the segment in Python; the ranks find their banks in C: the two agree,
    and every rank's pair of banks starts on a page of its own (first touched by its writer)."""
    assert lib is not None
    for n, max_t in ((1, 1), (2, 16), (3, 512)):
        cfg = _cfg(make_model, d_model=96, n_ff=200)
        L = SegmentLayout.for_model(cfg, n, max_t, int(lib.pi_comm_hdr_bytes()))
        assert L.banks_off == lib.pi_comm_banks_off(max_t) and L.rank_stride == lib.pi_comm_rank_stride(L.cap)
        assert L.banks_off % 65536 == 0 and L.rank_stride % 65536 == 0 and L.rank_stride >= 2 * 4 * L.cap
        assert L.lat_off >= L.banks_off + n * L.rank_stride


def test_ranks_that_disagree_on_a_row_fail_together_at_once(make_model: Callable[..., Path]) -> None:
    """Rank 1 thinks the row is 48 wide and owns [0, 48); rank 0 owns [48, 96) of 96: rank 1 finds
    rank 0's note outside its row and must wake rank 0 out of its wait (abort), not leave it to the
    60 s deadline."""
    assert lib is not None
    cfg = _cfg(make_model, d_model=96, n_ff=96)
    seg = create_segment(lib, cfg, 2, 1)
    comms = [RankComm(lib, seg, r) for r in range(2)]
    xs = [np.zeros(96, np.float32) for _ in range(2)]
    args, rcs = [(96, 48, 96), (48, 0, 48)], [-1, -1]

    def run(r: int) -> None:
        m, a, b = args[r]
        rcs[r] = lib.pi_comm_bench(ctypes.byref(comms[r].comm), m, a, b, 3, xs[r].ctypes.data)

    t0 = time.monotonic()
    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert time.monotonic() - t0 < 5.0
    assert sorted(rcs) == [10, 13]  # rank 1: more floats than the row holds; rank 0: aborted
    seg.close()


@pytest.mark.parametrize("cols", [((0, 32), (32, 64), (64, 96)), ((0, 50), (50, 50), (50, 96))])
def test_merge_gathers_every_rank_and_records_latency(make_model: Callable[..., Path], cols: tuple[tuple[int, int], ...]) -> None:
    """The micro-benchmark's own sync: each rank's columns arrive at every rank, every time, from
    that rank's own banks (uneven ranges, and a rank that owns nothing)."""
    assert lib is not None
    cfg = _cfg(make_model, d_model=96, n_ff=96)
    seg = create_segment(lib, cfg, 3, 1)
    comms = [RankComm(lib, seg, r) for r in range(3)]
    xs = [np.zeros(96, np.float32) for _ in range(3)]
    rcs = [-1] * 3

    def run(r: int) -> None:
        rcs[r] = lib.pi_comm_bench(ctypes.byref(comms[r].comm), 96, cols[r][0], cols[r][1], 500, xs[r].ctypes.data)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert rcs == [0, 0, 0]
    want = np.concatenate([np.full(b - a, r + 1, np.float32) for r, (a, b) in enumerate(cols)])
    for x in xs:
        np.testing.assert_array_equal(x, want)
    assert all(len(c.latencies_ns()) == 500 and c.latencies_ns().min() > 0 for c in comms)
    seg.close()


@pytest.mark.parametrize("n_workers", [1, 2, 3])
def test_pool_equals_native_inprocess(make_model: Callable[..., Path], n_workers: int) -> None:
    path = make_model(arch="gemma3", qtype=QT.Q8_0, n_layers=3)
    oracle = LLM(path, n_ctx=64, executor="inprocess", n_threads=1, native=True)
    llm = LLM(path, n_ctx=64, n_threads=n_workers, worker_threads=1, pin=False)
    try:
        assert isinstance(llm.engine.executor, NativePoolExecutor)
        np.testing.assert_array_equal(llm.logits(IDS), oracle.logits(IDS))
        a = [c.token for c in llm.generate(IDS, 8, temperature=0)]
        assert a == [c.token for c in oracle.generate(IDS, 8, temperature=0)]
        np.testing.assert_array_equal(llm.engine.eval(IDS[:3]), oracle.engine.eval(IDS[:3]))  # prompt: one STEP, last row's logits
    finally:
        pids = llm.engine.executor.pids  # type: ignore[attr-defined]
        llm.close()
    assert gone(pids)


def test_batched_decode_on_ranks_equals_each_alone(make_model: Callable[..., Path]) -> None:
    path = make_model(arch="qwen2", qtype=QT.Q4_0, n_layers=2)
    llm = LLM(path, n_ctx=32, n_threads=2, worker_threads=1, pin=False, n_slots=2)
    solo = LLM(path, n_ctx=32, executor="inprocess", n_threads=1, native=True)
    try:
        llm.engine.eval(IDS[:5], slot=0)
        llm.engine.eval(IDS[2:11], slot=1)
        got = llm.engine.decode([7, 9], [0, 1])
        for row, (prompt, tok) in enumerate(((IDS[:5], 7), (IDS[2:11], 9))):
            solo.engine.rewind_all()
            solo.engine.eval(prompt)
            np.testing.assert_array_equal(got[row], solo.engine.eval([tok])[0])
    finally:
        llm.close()


def test_rank_killed_inside_a_merge_fails_the_step_without_a_hang(make_model: Callable[..., Path]) -> None:
    """Rank 1 stopped, so rank 0 sits in a merge waiting for it; then rank 1 is killed."""
    llm = LLM(make_model(arch="llama"), n_ctx=128, n_threads=2, worker_threads=1, pin=False)
    ex = llm.engine.executor
    assert isinstance(ex, NativePoolExecutor)
    victim, survivor = ex.pids[1], ex.pids[0]
    try:
        llm.complete(IDS, max_tokens=2, temperature=0)
        os.kill(victim, signal.SIGSTOP)
        threading.Timer(0.5, os.kill, (victim, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="killed by SIGKILL while running a step"):
            llm.complete(IDS, max_tokens=8, temperature=0)
        assert time.monotonic() - t0 < 5.0
        # the survivor left its merge (abort / dead peer) and answered; the next request restarts the pool
        assert llm.complete(IDS, max_tokens=3, temperature=0)[1] in ("length", "stop")
        assert victim not in ex.pids and survivor not in ex.pids
    finally:
        pids = ex.pids
        llm.close()
    assert gone(pids + [victim, survivor])


def test_idle_pool_sleeps(make_model: Callable[..., Path]) -> None:
    llm = LLM(make_model(arch="llama"), n_ctx=64, n_threads=2, worker_threads=1, pin=False)
    try:
        llm.complete(IDS, max_tokens=4, temperature=0)
        procs = [psutil.Process(p) for p in llm.engine.executor.pids]  # type: ignore[attr-defined]
        time.sleep(0.3)  # past every spin
        before = [sum(p.cpu_times()[:2]) for p in procs]
        time.sleep(2.0)
        used = sum(sum(p.cpu_times()[:2]) - b for p, b in zip(procs, before))
        assert used < 0.1, f"idle workers used {used:.3f} CPU-s in 2 s"
    finally:
        llm.close()


def test_transport_choice_and_fallbacks(make_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    path = make_model(arch="llama")
    with pytest.raises(InvalidArgumentError, match="transport"):
        LLM(path, transport="udp")
    with pytest.raises(InvalidArgumentError, match="query head"):
        LLM(path, n_threads=5, worker_threads=1, pin=False, transport="shm")  # 4 query heads
    monkeypatch.setenv("POWERINFER_NATIVE", "0")
    with pytest.raises(InvalidArgumentError, match="shm is not possible"):
        LLM(path, n_threads=2, worker_threads=1, pin=False, transport="shm")
    with LLM(path, n_ctx=32, n_threads=2, worker_threads=1, pin=False) as llm:
        assert isinstance(llm.engine.executor, ProcessExecutor)
    assert "over ZeroMQ" in caplog.text


def test_step_messages_over_zeromq_equal_the_doorbell(make_model: Callable[..., Path]) -> None:
    """STEP/RESULT (the protocol's portable form of a step) give the same numbers as the doorbell."""
    path = make_model(arch="llama", qtype=QT.Q8_0, n_layers=2)
    llm = LLM(path, n_ctx=64, n_threads=2, worker_threads=1, pin=False)
    ex = llm.engine.executor
    assert isinstance(ex, NativePoolExecutor)
    try:
        want = llm.logits(IDS)
        tokens = [c.token for c in llm.generate(IDS, 6, temperature=0)]
        ex.step_channel = "zmq"
        np.testing.assert_array_equal(llm.logits(IDS), want)
        assert [c.token for c in llm.generate(IDS, 6, temperature=0)] == tokens
        assert ex.stats.syncs > 0 and ex.stats.wait_us >= 0
    finally:
        llm.close()


@pytest.mark.real_model
def test_ctrl_c_mid_step_lets_the_step_finish_and_the_pool_stays_usable(smollm2_path: Path) -> None:
    """An interrupt while the ranks are inside a pass is raised once the pass is done: no abort,
    no restart, and the next request computes the same numbers as ever."""
    llm = LLM(smollm2_path, n_ctx=600, n_threads=2, worker_threads=1, pin=False)
    ex = llm.engine.executor
    assert isinstance(ex, NativePoolExecutor)
    ids = llm.tokenize("The history of the city " * 100)[:500]  # a prefill of several wait slices
    try:
        want = llm.logits(ids[:40])
        real, calls = ex._pool.check_health, [0]

        def interrupting(what: str = "idle") -> None:
            calls[0] += 1
            if calls[0] == 1:
                raise KeyboardInterrupt
            real(what)

        ex._pool.check_health = interrupting  # type: ignore[method-assign]
        pids = list(ex.pids)
        with pytest.raises(KeyboardInterrupt):
            llm.engine.eval(ids)
        assert calls[0] >= 1 and ex.pids == pids  # the same workers: nothing was aborted
        ex._pool.check_health = real  # type: ignore[method-assign]
        np.testing.assert_array_equal(llm.logits(ids[:40]), want)
    finally:
        llm.close()


@pytest.mark.parametrize("mode", ["gate", "predictor"])
def test_sparse_ranks_equal_the_sparse_decoder_in_process(tmp_path: Path, mode: str) -> None:
    """With a predictor each rank computes its neurons' chosen gate and up rows; the merge is the
    dense one, so 1, 2 and 3 workers give the in-process sparse decoder's logits bit for bit."""
    from powerinfer.sparsity.calibrate import CalibrationSettings, calibrate
    from powerinfer.predictors.predictor_file import write_predictor
    from powerinfer.sparsity.relu_model import ReluSparseSpec, write_relu_sparse_gguf

    model = write_relu_sparse_gguf(tmp_path / "tiny.gguf", ReluSparseSpec.shape("tiny"))
    path = tmp_path / f"tiny.{mode}.predictor"
    # 95%: decode's neuron-major down projection runs too (at most 10% active)
    write_predictor(path, calibrate(model, CalibrationSettings(mode=mode, sparsity=0.95, tokens=128, window=64, steps=60)))
    ids = [256, *range(40, 60)]
    ref = LLM(model, n_ctx=64, executor="inprocess", predictor=path, n_threads=2)
    want = ref.logits(ids)
    text = ref.complete(ids, max_tokens=8, temperature=0)[0]
    for workers in (1, 2, 3):
        llm = LLM(model, n_ctx=64, predictor=path, n_threads=workers, worker_threads=1)
        try:
            assert isinstance(llm.engine.executor, NativePoolExecutor)
            np.testing.assert_array_equal(llm.logits(ids), want)
            assert llm.complete(ids, max_tokens=8, temperature=0)[0] == text  # decode: the chosen rows one quad at a time
        finally:
            llm.close()


def test_pool_stats_tell_imbalance_from_jitter_and_time_outside_native_code() -> None:
    from powerinfer.coordinator.stats import PoolStats

    s = PoolStats()
    s.add(100.0, [90.0, 80.0], [18.0, 1.0], 120)  # rank 0 waits for rank 1 every time: imbalance
    s.add(100.0, [90.0, 80.0], [18.0, 1.0], 120)
    assert s.calls == 2 and s.syncs == 240 and s.wait_share == pytest.approx(38 / 340)
    assert s.rank_wait_shares == pytest.approx([0.2, 0.0125])
    assert s.outside_share == pytest.approx(0.1)  # 10 us of each 100 us call outside the slower rank's native code
    s.reset()
    assert (s.calls, s.rank_wait_shares, s.outside_share) == (0, [], 0.0)
