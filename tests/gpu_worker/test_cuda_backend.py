"""What of the CUDA backend runs without a GPU: the rule that decides, on a card's first GEMV of a
weight type, whether the block kernel's output may replace the weight-per-lane kernel's, and the
choice of kernels by argument or environment (refused before any CUDA call when it is wrong).

Runs in: the pytest process (no pycuda needed).
"""

from __future__ import annotations

import numpy as np
import pytest

from powerinfer.errors import InvalidArgumentError
from powerinfer.gpu_worker.cuda_backend import GEMV_AGREE, GEMV_ENV, CudaBackend, gemv_disagreement


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
