"""Worker-side layer operations over one shard: a range of attention heads, a set of FFN neurons.

Runs in: a CPU worker process (or in the coordinator's process for the in-process executor).

Both operations return *partial sums* in model space [T, d_model]: the attention shard's slice of
the output projection, the FFN shard's slice of the down projection. The coordinator adds the
partials of all shards, so splitting a layer across workers changes only float summation order.
"""

from __future__ import annotations

import numpy as np
import torch

from powerinfer.config import ModelConfig
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.ops import RopeTable, activation, attend, attention_mask, neox_to_norm_perm
from powerinfer.model.sharding import HeadRange
from powerinfer.model.linears import load_linear
from powerinfer.model.weights import layer_bias, layer_tensor, load_vector
from powerinfer.quants import PackedLinear


class AttentionShard:
    """kv heads [kv_start, kv_stop) of one layer, their query heads, and their KV cache."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig, layer: int, heads: HeadRange, n_ctx: int, ropes: dict[tuple[float, float], RopeTable]) -> None:
        self.cfg, self.layer, self.heads = cfg, layer, heads
        D, Dv = cfg.head_dim, cfg.v_head_dim
        # Row order inside each q/k head: identity, or the permutation that lets NEOX-style models
        # use the adjacent-pair rope (q.k is unchanged when q and k are permuted alike).
        perm = neox_to_norm_perm(D, cfg.rope_dim) if cfg.rope_style == "neox" else np.arange(D)
        q_rows = (np.arange(heads.q_start, heads.q_stop)[:, None] * D + perm[None, :]).reshape(-1)
        k_rows = (np.arange(heads.kv_start, heads.kv_stop)[:, None] * D + perm[None, :]).reshape(-1)
        v_rows = slice(heads.kv_start * Dv, heads.kv_stop * Dv)
        self.n_q, self.n_k = len(q_rows), len(k_rows)
        # q, k and v rows of this shard fused into one matmul: [T, d] -> [T, (Hq + Hkv) * D + Hkv * Dv]
        self.qkv: PackedLinear = load_linear(
            f,
            [(layer_tensor(layer, "attn_q"), q_rows), (layer_tensor(layer, "attn_k"), k_rows), (layer_tensor(layer, "attn_v"), v_rows)],
        )
        self.bias: torch.Tensor | None = None
        if cfg.qkv_bias:
            self.bias = torch.from_numpy(
                np.concatenate(
                    [
                        load_vector(f, layer_bias(layer, "attn_q"))[q_rows],
                        load_vector(f, layer_bias(layer, "attn_k"))[k_rows],
                        load_vector(f, layer_bias(layer, "attn_v"))[v_rows],
                    ]
                )
            )
        # Gemma's per-head q and k norm weights, stacked to match the fused [Hq + Hkv, D] heads.
        self.qk_norm: torch.Tensor | None = None
        if cfg.qk_norm:
            q_norm = torch.from_numpy(load_vector(f, layer_tensor(layer, "attn_q_norm"), D)[perm])
            k_norm = torch.from_numpy(load_vector(f, layer_tensor(layer, "attn_k_norm"), D)[perm])
            self.qk_norm = torch.cat([q_norm.expand(heads.q_stop - heads.q_start, D), k_norm.expand(heads.n_kv, D)])
        # Columns of the output projection that read this shard's heads: [T, Hq * Dv] -> [T, d]
        self.out: PackedLinear = load_linear(
            f, [(layer_tensor(layer, "attn_output"), None)], cols=(heads.q_start * Dv, heads.q_stop * Dv)
        )
        key = cfg.layer_rope(layer)
        if key not in ropes:
            ropes[key] = RopeTable(cfg.rope_dim, key[0], key[1])
        self.rope = ropes[key]
        self.window = 0 if cfg.global_layers[layer] else cfg.sliding_window
        # KV cache indexed by absolute position: [Hkv_local, n_ctx, D], head-major so each head's
        # keys are one contiguous matrix for the score matmul. Positions past the current length
        # hold stale values that no mask ever lets a query see.
        self.k_cache = torch.zeros(heads.n_kv, n_ctx, D)
        self.v_cache = torch.zeros(heads.n_kv, n_ctx, Dv)

    @property
    def nbytes(self) -> int:
        return self.qkv.nbytes + self.out.nbytes + self.k_cache.nbytes + self.v_cache.nbytes

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, d] (already normed), positions [T] consecutive -> partial output [T, d]."""
        cfg, T = self.cfg, x.shape[0]
        qkv = self.qkv(x)
        if self.bias is not None:
            qkv = qkv + self.bias
        D = cfg.head_dim
        # q and k heads are adjacent in the fused output: [T, Hq + Hkv, D], normed and rotated together.
        qk = qkv[:, : self.n_q + self.n_k].reshape(T, -1, D)
        v = qkv[:, self.n_q + self.n_k :].reshape(T, -1, cfg.v_head_dim)
        if self.qk_norm is not None:
            qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * self.qk_norm
        qk = self.rope.apply(qk, positions)
        n_qh = self.n_q // D
        q, k = qk[:, :n_qh], qk[:, n_qh:]
        start, stop = int(positions[0]), int(positions[-1]) + 1
        self.k_cache[:, start:stop] = k.transpose(0, 1)
        self.v_cache[:, start:stop] = v.transpose(0, 1)
        # Sliding-window layers need only the last `window` keys; skip the rest of the cache.
        lo = max(0, start - self.window + 1) if self.window else 0
        mask = attention_mask(positions, lo, stop, self.window)
        out = attend(q, self.k_cache[:, lo:stop], self.v_cache[:, lo:stop], mask, cfg.attn_scale)
        return self.out(out)


class FFNShard:
    """A set of FFN neurons of one layer: their gate/up rows and their down-projection columns."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig, layer: int, neurons: np.ndarray) -> None:
        self.cfg, self.layer = cfg, layer
        self.neurons = neurons
        self.n = len(neurons)
        if self.n == 0 or neurons[-1] - neurons[0] + 1 != self.n:
            raise ValueError("an FFN shard is a non-empty contiguous neuron range")
        start, stop = int(neurons[0]), int(neurons[-1]) + 1
        # gate and up rows are neuron-major already: [T, d] -> [T, 2n]
        rows = slice(start, stop)
        self.gate_up: PackedLinear = load_linear(f, [(layer_tensor(layer, "ffn_gate"), rows), (layer_tensor(layer, "ffn_up"), rows)])
        # down [d, n_ff]: this shard's columns, [T, n] -> [T, d]
        self.down: PackedLinear = load_linear(f, [(layer_tensor(layer, "ffn_down"), None)], cols=(start, stop))

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] (already normed) -> partial output [T, d]."""
        gu = self.gate_up(x)  # [T, 2n]
        h = activation(gu[:, : self.n], self.cfg.activation) * gu[:, self.n :]
        return self.down(h)


class HeadShard:
    """Output-head rows (vocabulary ids) [start, stop): hidden [T, d] -> logits [T, stop - start]."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig, start: int, stop: int) -> None:
        name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        self.start, self.stop = start, stop
        self.linear: PackedLinear = load_linear(f, [(name, slice(start, stop))])

    @property
    def nbytes(self) -> int:
        return self.linear.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)
