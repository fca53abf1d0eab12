"""A neuron predictor's fc2 in the layout the decoder takes its sign from (kernels/pred_sign.h).

Runs in: the process that builds a native decoder's sparse layers (the in-process executor's
coordinator, each rank of the native pool), from native/sparse_layers.py's predictor_q8. numpy only.

fc2 [n, k] (float) becomes groups of 16 rows: 16 float16 scales (each row's largest magnitude /
127), then for each 4 of the k columns 16 rows x 4 int8 codes, so one 512-bit load feeds a dpbusd
with 16 rows' next four products: 2 + k bytes a row (Q8_0's 34 for each 32 of k, padded). Rows past n and columns past k are zero. The decoder compares
(codes . q(u)) x scale x su + b2 with 0, q(u) its input quantized per token with one scale: the
same decision as the float predictor up to the two 8-bit roundings.
"""

from __future__ import annotations

import numpy as np

from powerinfer.memory import weight_array

GROUP = 16  # rows a group: one 512-bit dpbusd's int32 lanes
SCALE_BYTES = 2 * GROUP


def sign_width(k: int) -> int:
    """The columns a group holds for fc2's k: k rounded up to whole dpbusd steps of 4."""
    return -(-k // 4) * 4


def sign_layout(fc2: np.ndarray, k: int) -> np.ndarray:
    """fc2's first k columns ([n, >= k] float) -> uint8 [ceil(n / 16), 32 + 16 sign_width(k)]."""
    n, kq = fc2.shape[0], sign_width(k)
    groups = -(-n // GROUP)
    w = np.zeros((groups * GROUP, kq), dtype=np.float32)
    w[:n, :k] = fc2[:, :k]
    scale = (np.abs(w).max(axis=1) / 127.0).astype(np.float16).astype(np.float32)  # [rows], as the decoder reads it
    codes = np.clip(np.rint(w / np.where(scale > 0, scale, 1.0)[:, None]), -127, 127).astype(np.int8)
    # [groups, 16 rows, kq / 4, 4] -> [groups, kq / 4, 16 rows, 4]: a vector is 16 rows' next 4 codes
    codes = codes.reshape(groups, GROUP, kq // 4, 4).transpose(0, 2, 1, 3)
    out = weight_array(groups * (SCALE_BYTES + GROUP * kq)).reshape(groups, -1)  # read every step: huge pages
    out[:, :SCALE_BYTES] = scale.astype(np.float16).reshape(groups, GROUP).view(np.uint8)
    out[:, SCALE_BYTES:] = codes.reshape(groups, -1).view(np.uint8)
    return out
