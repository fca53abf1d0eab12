"""Pipeline stages without Ray: two or three stages wired over ZeroMQ on the loopback answer what
the in-process native executor answers, for every Want and with a batch cut into micro-batches;
a refused input comes back as an error message, and the stages go on serving.

Runs in: the test process (each stage serves in a thread, as it would in its actor).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from gguf import GGMLQuantizationType as QT

from powerinfer.config import config_from_gguf
from powerinfer.coordinator.cluster.stage import Stage, StageSpec
from powerinfer.coordinator.cluster.wire import StageMsg, decode
from powerinfer.coordinator.executor import Batch, Want
from powerinfer.coordinator.native_executor import NativeExecutor
from powerinfer.gguf_file import GGUFFile
from powerinfer.native.decoder_lib import decoder_lib
from tests.coordinator.cluster.helpers import sparse_relu_model

pytestmark = pytest.mark.skipif(decoder_lib() is None, reason="no C compiler")


class Wired:
    """Stages in threads, and the coordinator's two sockets."""

    def __init__(self, path: Path, cuts: list[int], n_layers: int, predictor: str = "", ranks: int = 0) -> None:
        """ranks 0: each stage the decoder in process; else a native pool of that many ranks (not pinned)."""
        bounds = [0, *cuts, n_layers]
        self.stages = [Stage(StageSpec(i, len(bounds) - 1, str(path), a, b, 64, 2, 8, ranks or 1, predictor=predictor, pool=bool(ranks),
                                       pin=False)) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        self.ctx = zmq.Context()
        self.results, self.beats = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PULL)
        rp, hp = self.results.bind_to_random_port("tcp://127.0.0.1"), self.beats.bind_to_random_port("tcp://127.0.0.1")
        onward = [s.endpoint() for s in self.stages[1:]] + [f"tcp://127.0.0.1:{rp}"]
        for s, nxt in zip(self.stages, onward):
            s.connect(nxt, f"tcp://127.0.0.1:{hp}")
            threading.Thread(target=s.serve, daemon=True).start()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(self.stages[0].endpoint())
        self.step = 0

    def run(self, batch: Batch, parts: int) -> np.ndarray:
        """batch cut into parts micro-batches, all sent before any answer is read (as the pipeline executor
        does; it sends Want.ALL whole)."""
        ids, pos, slots = batch.arrays()
        self.step += 1
        chunks = np.array_split(np.arange(len(ids)), parts)
        for i, rows in enumerate(chunks):
            want = batch.want if batch.want is not Want.LAST or i == parts - 1 else Want.CACHE
            self.push.send_multipart(StageMsg(self.step, i, parts, want.value, "ids", pos[rows], slots[rows], ids[rows]).frames())
        outs = []
        for _ in chunks:
            assert self.results.poll(20000), "no answer from the last stage"
            m = decode(self.results.recv_multipart())
            if m.kind == "error":
                raise ValueError(m.error)
            outs.append(m.payload)
        if batch.want is Want.CACHE:
            return outs[0][:0]
        return outs[-1] if batch.want is Want.LAST else np.concatenate(outs)

    def close(self) -> None:
        for s in self.stages:
            s.stop()
        self.ctx.destroy(linger=0)


@pytest.fixture(params=[([1], 0), ([1, 2], 0), ([2], 2)], ids=["2 stages in process", "3 stages in process", "2 stages of 2 ranks"])
def wired(request: pytest.FixtureRequest, make_model: Callable[..., Path]) -> Iterator[tuple[Wired, NativeExecutor]]:
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=3)
    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    lib = decoder_lib()
    assert lib is not None
    oracle = NativeExecutor(lib, f, cfg, 64, 1, n_slots=2, max_tokens=8)
    cuts, ranks = request.param
    w = Wired(path, cuts, cfg.n_layers, ranks=ranks)
    yield w, oracle
    w.close()
    oracle.close()


def test_stages_answer_what_one_process_answers(wired: tuple[Wired, NativeExecutor]) -> None:
    w, oracle = wired
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, 200, 9).tolist()
    # slot 0: a prompt in two chunks (the first only cached), then decode steps; slot 1 joins
    steps = [(prompt[:5], 0, 0, Want.CACHE, 2), (prompt[5:], 5, 0, Want.LAST, 2), (prompt[:4], 0, 1, Want.ALL, 1),
             ([7], 9, 0, Want.LAST, 1), ([8, 9], None, None, Want.EACH, 2), (prompt[:3], 0, 1, Want.HIDDEN, 2)]
    for ids, p0, slot, want, parts in steps:
        if p0 is None:  # one decode row per slot: slot 0 at 10, slot 1 at 4
            batch = Batch(ids, [10, 4], [0, 1], want)
        else:
            batch = Batch(ids, list(range(p0, p0 + len(ids))), [slot] * len(ids), want)
        got, want_ = w.run(batch, parts), oracle.execute(batch)
        assert got.shape == want_.shape, (want, got.shape, want_.shape)
        np.testing.assert_allclose(got, want_, rtol=1e-5, atol=1e-5, err_msg=str(want))


def test_a_refused_input_comes_back_as_an_error_and_serving_goes_on(wired: tuple[Wired, NativeExecutor]) -> None:
    w, _ = wired
    with pytest.raises(ValueError, match="pipeline stage 0: .*refused"):
        w.run(Batch([1, 2], [70, 71], [0, 0], Want.LAST), 1)  # beyond the context of 64
    assert w.run(Batch([1, 2], [0, 1], [0, 0], Want.LAST), 1).shape[0] == 1


def test_sparse_stages_answer_what_the_sparse_native_executor_answers(make_model: Callable[..., Path], tmp_path: Path) -> None:
    """A ReGLU model with a predictor file: two stages, each applying the rule to its own layers,
    give the in-process sparse executor's logits, and count the neurons they computed."""
    path, pf, pred = sparse_relu_model(make_model, tmp_path, 3)
    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    lib = decoder_lib()
    assert lib is not None
    oracle = NativeExecutor(lib, f, cfg, 64, 1, n_slots=2, max_tokens=8, predictor=pf)
    w = Wired(path, [2], cfg.n_layers, predictor=str(pred))
    try:
        ids = np.random.default_rng(2).integers(3, 200, 10).tolist()
        # a prompt of 10 whole (a sparse FFN's pass over more than 4 tokens depends on its tokens: the
        # pipeline does not cut it), then two sequences' decode in two micro-batches (by rows either way)
        for batch, parts in ((Batch(ids, list(range(10)), [0] * 10, Want.LAST), 1), (Batch([5, 6], [10, 0], [0, 1], Want.EACH), 2)):
            np.testing.assert_allclose(w.run(batch, parts), oracle.execute(batch), rtol=1e-5, atol=1e-5)
        counts = [s.sparse_counts() for s in w.stages]
        assert [len(c[0]) for c in counts] == [2, 1] and all(c[2] == 12 for c in counts)
        share = np.mean([a / (c[2] * cfg.n_ff) if sp else 1.0 for c in counts for a, sp in zip(c[0], c[1])])
        assert 0 < share < 1 and abs(share - oracle.decode_share()) < 1e-9
    finally:
        w.close()
        oracle.close()
