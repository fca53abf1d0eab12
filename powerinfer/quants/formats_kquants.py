"""Vectorized numpy decoders for the GGML K-quant super-blocks (Q4_K, Q5_K, Q6_K) to :class:`Grouped`.

Runs in: any process (coordinator or worker); pure numpy, reads the block bytes without writing.

Each decoder takes ``blocks``: uint8 [N, nb, type_size] (N rows, nb super-blocks of 256 weights per
row; usually a read-only view into the memory-mapped file) and returns the group form. The bit
layouts follow ggml's ``dequantize_row_q*_K`` (reference: ``gguf/quants.py``): the Grouped result
dequantizes to exactly the same float32 values as the reference.
"""

from __future__ import annotations

import numpy as np

from powerinfer.quants.grouped import Grouped

QK_K = 256  # weights per K-quant super-block


def f16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 stored at byte ``offset`` of every block, as float32 [N, nb]."""
    # blocks[..., o:o+2] has a contiguous last axis, so the dtype view is legal and copies nothing.
    return blocks[..., offset : offset + 2].view(np.float16)[..., 0].astype(np.float32)


def _scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte 6-bit scales/mins of Q4_K/Q5_K: uint8 [N, nb, 12] -> two uint8 [N, nb, 8].

    Bytes 0..3 hold sc[0..3] (low 6 bits) and the top 2 bits of sc[4..7]; bytes 4..7 the same for the
    mins; bytes 8..11 hold the low 4 bits of sc[4..7] (low nibble) and m[4..7] (high nibble).
    """
    d = packed[..., 0:4]
    m = packed[..., 4:8]
    md = packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _low_nibbles_k(qs: np.ndarray) -> np.ndarray:
    """uint8 [N, nb, 128] -> uint8 [N, nb, 8, 32]: 32-byte chunk i gives sub-blocks 2i (low) and 2i+1 (high)."""
    n, nb = qs.shape[:2]
    chunks = qs.reshape(n, nb, 4, 32)
    out = np.empty((n, nb, 4, 2, 32), dtype=np.uint8)
    np.bitwise_and(chunks, 0x0F, out=out[:, :, :, 0])
    np.right_shift(chunks, 4, out=out[:, :, :, 1])
    return out.reshape(n, nb, 8, 32)


def _scales_zeros_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-32 scale d*sc and zero -dmin*m of Q4_K/Q5_K: float32 [N, nb*8] each."""
    n, nb = blocks.shape[:2]
    d = f16_field(blocks, 0)  # [N, nb]
    dmin = f16_field(blocks, 2)
    sc, mn = _scale_min_k4(blocks[..., 4:16])
    scale = d[..., None] * sc.astype(np.float32)  # [N, nb, 8]
    # ggml subtracts dmin*m; storing its negation keeps q*scale + zero bit-identical to that.
    zero = -(dmin[..., None] * mn.astype(np.float32))
    return scale.reshape(n, nb * 8), zero.reshape(n, nb * 8)


def decode_q4_k(blocks: np.ndarray) -> Grouped:
    """Q4_K (144 bytes): d f16, dmin f16, scales[12], qs[128] -> codes 0..15, group 32, bits 4."""
    n, nb = blocks.shape[:2]
    codes = _low_nibbles_k(blocks[..., 16:144])  # [N, nb, 8, 32]
    scale, zero = _scales_zeros_k(blocks)
    return Grouped(codes.view(np.int8).reshape(n, nb * QK_K), scale, zero, 32, 4)


def decode_q5_k(blocks: np.ndarray) -> Grouped:
    """Q5_K (176 bytes): d, dmin, scales[12], qh[32], qs[128] -> codes 0..31 (unsigned), group 32."""
    n, nb = blocks.shape[:2]
    codes = _low_nibbles_k(blocks[..., 48:176])  # [N, nb, 8, 32]
    # Bit j of qh[l] is the fifth bit of element l of sub-block j: unpack to [N, nb, 32, 8] then
    # swap to [N, nb, 8, 32] to line up with the nibbles.
    high = np.unpackbits(blocks[..., 16:48, None], axis=-1, bitorder="little")
    codes |= high.transpose(0, 1, 3, 2) << np.uint8(4)
    scale, zero = _scales_zeros_k(blocks)
    return Grouped(codes.view(np.int8).reshape(n, nb * QK_K), scale, zero, 32, 8)


def decode_q6_k(blocks: np.ndarray) -> Grouped:
    """Q6_K (210 bytes): ql[128], qh[64], scales int8[16], d f16 -> signed codes -32..31, group 16."""
    n, nb = blocks.shape[:2]
    # Each 128-weight half h uses ql[64h:64h+64] and qh[32h:32h+32]; element 32s + l of the half
    # (s = 0..3, l = 0..31) takes low bits from ql[(s & 1) * 32 + l] (low nibble for s < 2, high
    # nibble otherwise) and its top two bits from qh[l] >> 2s.
    ql = blocks[..., 0:128].reshape(n, nb, 2, 2, 32)  # [N, nb, half, s & 1, l]
    qh = blocks[..., 128:192].reshape(n, nb, 2, 1, 32)  # [N, nb, half, 1, l]
    low = np.empty((n, nb, 2, 2, 2, 32), dtype=np.uint8)  # [N, nb, half, s >> 1, s & 1, l]
    np.bitwise_and(ql, 0x0F, out=low[:, :, :, 0])
    np.right_shift(ql, 4, out=low[:, :, :, 1])
    low = low.reshape(n, nb, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & np.uint8(3)
    low |= high << np.uint8(4)
    low -= np.uint8(32)  # wraps mod 256; the int8 view then reads code - 32
    d = f16_field(blocks, 208)  # [N, nb]
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)  # [N, nb, 16]
    scale = (d[..., None] * sc).reshape(n, nb * 16)
    zero = np.zeros_like(scale)
    return Grouped(low.view(np.int8).reshape(n, nb * QK_K), scale, zero, 16, 8)
