"""Small tensor operations of the transformer forward pass (torch, float32).

Runs in: the coordinator (norms, embedding scale) and CPU workers (rope, attention).
Shapes in comments: T = tokens in the step, S = cached positions, H = heads, D = head width.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from powerinfer.config import ModelConfig
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.weights import layer_bias, load_vector


def activation(gate: torch.Tensor, kind: str, threshold: float = 0.0) -> torch.Tensor:
    """act(gate) [T, n] of config.py's activation kind (threshold: FATReLU's)."""
    if kind == "silu":
        return F.silu(gate)
    if kind == "gelu_tanh":  # ggml_gelu is the tanh approximation
        return F.gelu(gate, approximate="tanh")
    if kind == "fatrelu":  # gate where gate > threshold, else 0 (F.threshold's rule)
        return F.threshold(gate, threshold, 0.0)
    if kind in ("relu", "drelu"):
        return F.relu(gate)
    raise ValueError(f"unknown activation {kind!r}")


def up_value(up: torch.Tensor, kind: str) -> torch.Tensor:
    """The up projection as the activation multiplies it: dReLU rectifies it too."""
    return F.relu(up) if kind == "drelu" else up


def ffn_up_bias(f: GGUFFile, cfg: ModelConfig, layer: int, neurons: np.ndarray) -> torch.Tensor | None:
    """fc1's bias of these neurons, float32 [n], for OPT's gate-less FFN (cfg.gated_ffn False); else None."""
    if cfg.gated_ffn:
        return None
    return torch.from_numpy(load_vector(f, layer_bias(layer, "ffn_up"), cfg.n_ff)[neurons])


def ffn_hidden(gu: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(gate), the hidden state act(gate) * up) [T, n] of a shard's packed gate|up output gu
    [T, 2n]; OPT (bias given): gu is fc1's output [T, n], act(gu + b) twice."""
    if bias is not None:
        g = activation(gu + bias, cfg.activation, cfg.act_threshold)
        return g, g
    n = gu.shape[1] // 2
    g = activation(gu[:, :n], cfg.activation, cfg.act_threshold)
    return g, g * up_value(gu[:, n:], cfg.activation)


def glu(gate: torch.Tensor, up: torch.Tensor, kind: str, threshold: float = 0.0) -> torch.Tensor:
    """The gated FFN's hidden state act(gate) * up [T, n] (relu(gate) * relu(up) for dReLU)."""
    return activation(gate, kind, threshold) * up_value(up, kind)


def neox_to_norm_perm(head_dim: int, rope_dim: int) -> np.ndarray:
    """Row order [head_dim] that turns NEOX rope (pairs i, i + r/2) into adjacent pairs (2i, 2i+1).

    Permuting the q and k rows of every head the same way leaves q.k unchanged, so models that
    rotate halves (qwen2, gemma3) run through the one adjacent-pair rope below.
    """
    half = rope_dim // 2
    perm = np.arange(head_dim)
    perm[:rope_dim:2] = np.arange(half)
    perm[1:rope_dim:2] = np.arange(half, rope_dim)
    return perm


class RopeTable:
    """Rotations e^(i * pos * theta_j) for one (base, scale) pair, grown on demand.

    Dimensions (2j, 2j+1) of each head are one complex number, rotated by one complex multiply.
    """

    def __init__(self, rope_dim: int, base: float, scale: float, freq_factors: torch.Tensor | None = None) -> None:
        self.rope_dim = rope_dim
        # inv_freq [rope_dim / 2]
        inv = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim))
        if freq_factors is not None:
            inv = inv / freq_factors.to(torch.float64)
        self.inv_freq = inv * scale
        self.cis = torch.empty(0, rope_dim // 2, dtype=torch.complex64)

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self.cis.shape[0], 256)
        angles = torch.arange(n, dtype=torch.float64)[:, None] * self.inv_freq[None, :]  # [n, R/2]
        self.cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] float32 rotated at positions [T] (only the first rope_dim dims of each head)."""
        # The largest position, not the last: a batched decode step holds one token of each
        # sequence, in slot order, so an older, longer sequence can sit anywhere in the batch.
        top = int(positions.max())
        if top >= self.cis.shape[0]:
            self._grow(top + 1)
        cis = self.cis[positions][:, None, :]  # [T, 1, R/2]
        T, H, D = x.shape
        r = self.rope_dim
        if r == D:
            return torch.view_as_real(torch.view_as_complex(x.reshape(T, H, D // 2, 2)) * cis).reshape(T, H, D)
        rot = torch.view_as_real(torch.view_as_complex(x[..., :r].reshape(T, H, r // 2, 2)) * cis).reshape(T, H, r)
        return torch.cat((rot, x[..., r:]), dim=-1)


def attention_mask(q_pos: torch.Tensor, k_start: int, k_stop: int, window: int) -> torch.Tensor | None:
    """Boolean mask [T, S] (True = attend) for queries at q_pos [T] over keys at k_start..k_stop-1.

    None when every query may see every key (a decode step inside the window), so it is skipped.
    """
    if q_pos.numel() == 1 and int(q_pos[0]) == k_stop - 1 and (window == 0 or k_stop - k_start <= window):
        return None
    k_pos = torch.arange(k_start, k_stop)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window:
        # llama.cpp's standard SWA: key hidden once q_pos - k_pos >= window.
        mask &= (q_pos[:, None] - k_pos[None, :]) < window
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k [Hkv, S, D], v [Hkv, S, Dv] -> [T, Hq * Dv].

    Grouped-query heads are folded into the query axis, [Hkv, g*T, D], so each kv head is read
    once and never copied per query head.
    """
    T, Hq, D = q.shape
    Hkv = k.shape[0]
    g = Hq // Hkv
    if mask is None and T == 1:
        # Decode: two small batched matmuls beat SDPA's setup cost.
        p = torch.softmax(torch.bmm(q.reshape(Hkv, g, D) * scale, k.transpose(1, 2)), dim=-1)  # [Hkv, g, S]
        return torch.bmm(p, v).reshape(1, -1)  # [Hkv, g, Dv] -> [1, Hq * Dv]
    qg = q.reshape(T, Hkv, g, D).permute(1, 2, 0, 3).reshape(Hkv, g * T, D)
    m = None if mask is None else mask.repeat(g, 1)  # [g*T, S]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=scale)
    return out.reshape(Hkv, g, T, -1).permute(2, 0, 1, 3).reshape(T, -1)
