"""What of the CUDA backend runs without a GPU: the rule that decides, on a card's first GEMV of a
weight type, whether the block kernel's output may replace the weight-per-lane kernel's, and the
choice of kernels by argument or environment (refused before any CUDA call when it is wrong), and
the comparison itself on a faked pycuda.

Runs in: the pytest process (no pycuda needed).
"""

from __future__ import annotations

import numpy as np
import pytest

from powerinfer.errors import InvalidArgumentError
from powerinfer.gpu_worker.backend import disagreement as gemv_disagreement
from powerinfer.gpu_worker.cuda_backend import GEMV_AGREE, GEMV_ENV, CudaBackend


def test_disagreement_is_relative_to_the_outputs_scale() -> None:
    lanes = np.array([0.0, 100.0, -50.0, 0.0], np.float32)
    assert gemv_disagreement(lanes.copy(), lanes) == 0.0
    assert gemv_disagreement(lanes + np.float32(1e-3), lanes) <= GEMV_AGREE  # float32 reordering noise
    assert gemv_disagreement(lanes + np.array([0, 0, 0.5, 0], np.float32), lanes) == pytest.approx(0.005)
    assert gemv_disagreement(np.zeros(4, np.float32), np.zeros(4, np.float32)) == 0.0
    assert gemv_disagreement(np.array([1.0, 0], np.float32), np.zeros(2, np.float32)) == float("inf")


def test_non_finite_where_the_reference_is_finite_disagrees() -> None:
    lanes = np.array([1.0, 2.0], np.float32)
    assert gemv_disagreement(np.array([1.0, np.nan], np.float32), lanes) == float("inf")
    both = np.array([np.inf, 2.0], np.float32)
    assert gemv_disagreement(both.copy(), both) == 0.0  # the same overflow in both: compared on the rest


def test_a_wrong_kernel_choice_is_refused_before_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GEMV_ENV, "fastest")
    with pytest.raises(InvalidArgumentError, match="auto, blocks, lanes.*'fastest'"):
        CudaBackend(1 << 20)
    monkeypatch.delenv(GEMV_ENV)
    with pytest.raises(InvalidArgumentError, match="'warp'"):
        CudaBackend(1 << 20, gemv="warp")


class _FakeAlloc:
    def __init__(self, store: dict[int, np.ndarray], n_bytes: int) -> None:
        self.ptr = 0x1000 * (len(store) + 1)
        store[self.ptr] = np.zeros(n_bytes // 4, np.float32)
        self.freed = False

    def __int__(self) -> int:
        return self.ptr

    def free(self) -> None:
        self.freed = True


class _FakeCuda:
    """The few pycuda calls the GEMV choice makes; launches write what `outputs` says per kernel."""

    class MemoryError(Exception):
        pass

    def __init__(self, outputs: dict[str, np.ndarray], fail_alloc: bool = False) -> None:
        self.mem: dict[int, np.ndarray] = {}
        self.allocs: list[_FakeAlloc] = []
        self.outputs, self.fail_alloc = outputs, fail_alloc

    def mem_alloc(self, n_bytes: int) -> _FakeAlloc:
        if self.fail_alloc:
            raise self.MemoryError("out of memory")
        self.allocs.append(_FakeAlloc(self.mem, n_bytes))
        return self.allocs[-1]

    def memset_d32_async(self, buf: _FakeAlloc, value: int, count: int, stream: object) -> None:
        self.mem[int(buf)][:count] = value

    def memcpy_dtoh(self, host: np.ndarray, buf: _FakeAlloc) -> None:
        host[:] = self.mem[int(buf)][: host.size]


class _FakeStream:
    def synchronize(self) -> None:
        pass


def _backend(outputs: dict[str, np.ndarray], mode: str = "auto", fail_alloc: bool = False) -> tuple[CudaBackend, list[tuple[str, int]]]:
    b = CudaBackend.__new__(CudaBackend)  # no CUDA: the parts gemv() touches, faked
    fake = _FakeCuda(outputs, fail_alloc)
    b.cuda, b.stream = fake, _FakeStream()
    launches: list[tuple[str, int]] = []

    def launch(name: str, grid: tuple[int, ...], block: int, *args: int) -> None:
        y = args[-2]  # (..., y, ldy)
        launches.append((name, y))
        if y in fake.mem:  # a scratch buffer of the comparison
            fake.mem[y][: outputs[name].size] = outputs[name]

    b._launch = launch  # type: ignore[method-assign]
    b.use_gemv(mode)
    return b, launches


def _call(b: CudaBackend, suffix: str = "q4_0") -> None:
    from powerinfer.gpu_worker.cuda_backend import DeviceBuffer

    buf = DeviceBuffer(0xBEEF, 6, np.dtype(np.float32), None)
    b.gemv(suffix, buf, 18, None, None, 3, buf, 32, 2, DeviceBuffer(0xF00D, 6, np.dtype(np.float32), None), 3)


def test_auto_keeps_the_block_kernel_when_both_agree_and_only_checks_once() -> None:
    ref = np.arange(6, dtype=np.float32)
    b, launches = _backend({"gemv_q4_0": ref * np.float32(1 + 1e-6), "gemv_lanes_q4_0": ref})
    _call(b)
    _call(b)
    assert [n for n, _ in launches] == ["gemv_q4_0", "gemv_lanes_q4_0", "gemv_q4_0", "gemv_q4_0"]
    assert launches[-1][1] == 0xF00D and all(a.freed for a in b.cuda.allocs)  # type: ignore[attr-defined]


def test_auto_falls_back_to_the_lane_kernel_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    ref = np.arange(6, dtype=np.float32)
    b, launches = _backend({"gemv_q8_0": ref + np.float32(1.0), "gemv_lanes_q8_0": ref})
    with caplog.at_level("WARNING"):
        _call(b, "q8_0")
    assert launches[-1] == ("gemv_lanes_q8_0", 0xF00D)
    assert "differs from the weight-per-lane kernel" in caplog.text
    b2, launches2 = _backend({}, fail_alloc=True)
    _call(b2)
    assert launches2 == [("gemv_lanes_q4_0", 0xF00D)]


@pytest.mark.parametrize("mode,kernel", [("blocks", "gemv_q4_1"), ("lanes", "gemv_lanes_q4_1")])
def test_a_forced_mode_compares_nothing(mode: str, kernel: str) -> None:
    b, launches = _backend({}, mode)
    _call(b, "q4_1")
    assert launches == [(kernel, 0xF00D)]


def test_auto_learns_nothing_from_an_all_zero_output_and_tries_again() -> None:
    """A first call with nothing to compare (a device count of 0) must not settle the choice."""
    from powerinfer.gpu_worker.cuda_backend import GEMV_CHECK_TRIES

    zeros = np.zeros(6, np.float32)
    b, launches = _backend({"gemv_q4_0": zeros + np.float32(5.0), "gemv_lanes_q4_0": zeros})  # a broken block kernel
    _call(b)
    assert launches[-1] == ("gemv_lanes_q4_0", 0xF00D) and "q4_0" not in b._gemv_kernel
    b.cuda.outputs["gemv_lanes_q4_0"] = np.arange(6, dtype=np.float32)  # type: ignore[attr-defined]
    _call(b)  # now informative: the block kernel disagrees
    assert b._gemv_kernel["q4_0"] == "gemv_lanes_q4_0"
    z, zl = _backend({"gemv_q4_0": zeros, "gemv_lanes_q4_0": zeros})
    for _ in range(GEMV_CHECK_TRIES):
        _call(z)
    assert z._gemv_kernel["q4_0"] == "gemv_lanes_q4_0"  # never informative: settles on the safe kernel
