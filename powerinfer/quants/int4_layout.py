"""Reading torch's packed int4 weights back: the codes of ``_convert_weight_to_int4pack_for_cpu``.

Runs in: any process that holds int4 linears (dequantized() for the sparse down projections and
profiling, and the tests). torch's layout depends on the CPU capability it dispatches to, so it is
learned once per process from a probe instead of assumed.
"""

from __future__ import annotations

import functools

import torch


def unpack_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """uint8 [N, K] codes 0..15 of a uint8 [N, K / 2] matrix packed by this process's torch."""
    return _unpack(packed.reshape(-1), n, k, *_layout())


def _unpack(flat: torch.Tensor, n: int, k: int, block: int, split: bool) -> torch.Tensor:
    """uint8 [N, K] codes from torch's packed int4 bytes (flat [N * K / 2]) under one layout: rows in
    blocks of `block`, each block [K, block / 2] bytes whose byte j holds rows (j, j + block / 2) when
    `split`, else rows (2j, 2j + 1); a last partial block always holds pairs of rows."""
    out = torch.empty(n, k, dtype=torch.uint8)
    full = n // block * block
    if full:
        b = flat[: full * k // 2].view(full // block, k, block // 2)
        if split:
            rows = torch.cat([b & 15, b >> 4], dim=2)  # [blocks, K, block]
        else:
            rows = torch.stack([b & 15, b >> 4], dim=3).reshape(full // block, k, block)
        out[:full] = rows.transpose(1, 2).reshape(full, k)
    tail = n - full
    if tail:
        b = flat[full * k // 2 :].view(k, tail // 2)
        out[full:] = torch.stack([b & 15, b >> 4], dim=2).reshape(k, tail).T
    return out


@functools.cache
def _layout() -> tuple[int, bool]:
    """The (block, split) layout of this process's ``_convert_weight_to_int4pack_for_cpu``. It follows
    the CPU capability torch picked (AVX512: blocks of 64 split in halves; AVX2: 32 split; no SIMD:
    32 in pairs), so it is found once by packing random codes and keeping the reading that gives
    them back, never assumed: a wrong reading would make dequantized() (the sparse down
    projections, profiling) silently wrong on another machine."""
    n, k = 112, 64  # full blocks and a partial one under every candidate
    probe = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    flat = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1).reshape(-1)
    for block in (64, 32, 16):
        for split in (True, False):
            if torch.equal(_unpack(flat, n, k, block, split).to(torch.int32), probe):
                return block, split
    raise RuntimeError(f"this torch build ({torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}) "
                       "packs int4 weights in a layout PowerInfer-Py does not know; please report it")
