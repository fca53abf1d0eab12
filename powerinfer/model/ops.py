"""Small tensor operations of the transformer forward pass (torch, float32).

Runs in: the coordinator (norms, embedding scale) and CPU workers (rope, attention).
Shapes in comments: T = tokens in the step, S = cached positions, H = heads, D = head width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from powerinfer.config import RopeStyle


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] normalised over the last dim, times weight [n] (Gemma's +1 is baked into the file)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def activation(gate: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "silu":
        return F.silu(gate)
    # ggml_gelu is the tanh approximation.
    return F.gelu(gate, approximate="tanh")


class RopeTable:
    """cos/sin tables for one (base, scale) pair, grown on demand up to the context size."""

    def __init__(self, rope_dim: int, base: float, scale: float, style: RopeStyle, freq_factors: torch.Tensor | None = None) -> None:
        self.rope_dim = rope_dim
        self.style = style
        # inv_freq [rope_dim / 2]
        inv = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim))
        if freq_factors is not None:
            inv = inv / freq_factors.to(torch.float64)
        self.inv_freq = inv * scale
        self.cos = torch.empty(0, rope_dim // 2)
        self.sin = torch.empty(0, rope_dim // 2)

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self.cos.shape[0], 256)
        angles = torch.arange(n, dtype=torch.float64)[:, None] * self.inv_freq[None, :]  # [n, R/2]
        self.cos = angles.cos().float()
        self.sin = angles.sin().float()

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] rotated at positions [T] (only the first rope_dim dims of each head)."""
        need = int(positions.max()) + 1
        if need > self.cos.shape[0]:
            self._grow(need)
        cos = self.cos[positions][:, None, :]  # [T, 1, R/2]
        sin = self.sin[positions][:, None, :]
        r = self.rope_dim
        rot, rest = x[..., :r], x[..., r:]
        if self.style == "norm":
            # ggml NORM: adjacent pairs (0,1), (2,3), ...
            a, b = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        else:
            # NEOX: halves (i, i + r/2)
            a, b = rot[..., : r // 2], rot[..., r // 2 :]
            out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def attention_mask(q_pos: torch.Tensor, n_keys: int, window: int) -> torch.Tensor | None:
    """Boolean mask [T, S] (True = attend) for queries at q_pos [T] over cache positions 0..S-1.

    None when every query may see every cached key (decode without a window), so SDPA can skip it.
    """
    k_pos = torch.arange(n_keys)
    if q_pos.numel() == 1 and int(q_pos[0]) == n_keys - 1 and (window == 0 or n_keys <= window):
        return None
    mask = k_pos[None, :] <= q_pos[:, None]
    if window:
        # llama.cpp's standard SWA: key hidden once q_pos - k_pos >= window.
        mask &= (q_pos[:, None] - k_pos[None, :]) < window
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [S, Hkv, D] -> [T, Hq * Dv]; grouped-query heads share kv heads."""
    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)  # [Hq, T, D]
    kh = k.transpose(0, 1)  # [Hkv, S, D]
    vh = v.transpose(0, 1)
    if group > 1:
        kh = kh.repeat_interleave(group, dim=0)
        vh = vh.repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)  # [Hq, T, Dv]
    return out.transpose(0, 1).reshape(q.shape[0], -1)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(logits / cap) * cap if cap else logits

