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
from powerinfer.model.linears import load_linear
from powerinfer.model.ops import RopeTable, attend, attention_mask, ffn_hidden, ffn_up_bias, neox_to_norm_perm
from powerinfer.model.sharding import HeadRange, down_columns, packs_as_columns
from powerinfer.model.weights import layer_bias, layer_tensor, load_vector
from powerinfer.quants import Int8Packer, PackedLinear


class AttentionShard:
    """kv heads [kv_start, kv_stop) of one layer, their query heads, and their KV cache."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig, layer: int, heads: HeadRange, n_ctx: int, ropes: dict[tuple[float, float], RopeTable],
                 n_slots: int = 1) -> None:
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
        if key not in ropes and cfg.rope_dim:
            ropes[key] = RopeTable(cfg.rope_dim, key[0], key[1])
        self.rope = ropes.get(key)  # None: no rotary positions (OPT's are added to the embeddings)
        self.window = 0 if cfg.global_layers[layer] else cfg.sliding_window
        # KV cache per slot (sequence), indexed by absolute position: [slots, Hkv_local, n_ctx, D],
        # head-major so each head's keys are one contiguous matrix for the score matmul. Only
        # positions a sequence has written are ever read (attention slices [lo, stop)), so the
        # cache is left uninitialised: its pages are touched only as sequences grow into them.
        self.k_cache = torch.empty(n_slots, heads.n_kv, n_ctx, D)
        self.v_cache = torch.empty(n_slots, heads.n_kv, n_ctx, Dv)

    @property
    def nbytes(self) -> int:
        return self.qkv.nbytes + self.out.nbytes + self.k_cache.nbytes + self.v_cache.nbytes

    def forward(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, d] (already normed), positions [T], slots [T] (None: all slot 0) -> partial output [T, d].

        Either every token is in one slot at consecutive positions (a prompt chunk), or each token
        is in its own slot (a batched decode step: one token of each of T sequences).
        """
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
        if self.rope is not None:
            qk = self.rope.apply(qk, positions)
        n_qh = self.n_q // D
        q, k = qk[:, :n_qh], qk[:, n_qh:]
        first = 0 if slots is None else int(slots[0])
        if T == 1 or slots is None or bool((slots == first).all()):
            return self.out(self._attend_one(first, q, k, v, positions))
        # batched decode: each sequence attends over its own cache (the projections above and the
        # output projection below are what batching shares)
        outs = [self._attend_one(int(slots[i]), q[i : i + 1], k[i : i + 1], v[i : i + 1], positions[i : i + 1]) for i in range(T)]
        return self.out(torch.cat(outs))

    def _attend_one(self, slot: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One sequence's tokens q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] at consecutive positions -> [T, Hq * Dv]."""
        if not 0 <= slot < self.k_cache.shape[0]:
            raise ValueError(f"KV-cache slot {slot} out of range (this worker holds {self.k_cache.shape[0]})")
        start, stop = int(positions[0]), int(positions[-1]) + 1
        if stop - start != positions.shape[0] or stop > self.k_cache.shape[2] or start < 0:
            raise ValueError(f"positions {start}..{stop - 1} are not consecutive or exceed the context of {self.k_cache.shape[2]}")
        kc, vc = self.k_cache[slot], self.v_cache[slot]
        kc[:, start:stop] = k.transpose(0, 1)
        vc[:, start:stop] = v.transpose(0, 1)
        # Sliding-window layers need only the last `window` keys; skip the rest of the cache.
        lo = max(0, start - self.window + 1) if self.window else 0
        mask = attention_mask(positions, lo, stop, self.window)
        return attend(q, kc[:, lo:stop], vc[:, lo:stop], mask, self.cfg.attn_scale)


class FFNShard:
    """A set of FFN neurons of one layer: their gate/up rows and their down-projection columns
    (OPT: its up rows with their bias, act(up + b), no gate; down's bias is the engine's, added once).

    A range on the quantization groups packs the down columns like the unsharded matrix. Any other
    set (the cold neurons next to a GPU worker's hot ones) gathers its columns into int8 with the
    full rows' scales: exactly those columns where the unsharded down is int8 (Q6_K), a fine
    requantization of them otherwise.
    """

    def __init__(self, f: GGUFFile, cfg: ModelConfig, layer: int, neurons: np.ndarray) -> None:
        self.cfg, self.layer = cfg, layer
        self.neurons = neurons
        self.n = len(neurons)
        if self.n == 0 or np.any(np.diff(neurons) <= 0):
            raise ValueError("an FFN shard is a non-empty sorted set of distinct neurons")
        start, stop = int(neurons[0]), int(neurons[-1]) + 1
        contiguous = packs_as_columns(f, layer, neurons)
        # gate and up rows are neuron-major already: [T, d] -> [T, 2n]
        rows: slice | np.ndarray = slice(start, stop) if contiguous else np.asarray(neurons, dtype=np.int64)
        self.gate_up: PackedLinear = load_linear(f, [(layer_tensor(layer, part), rows) for part in cfg.ffn_parts])
        self.bias = ffn_up_bias(f, cfg, layer, neurons)
        # down [d, n_ff]: this shard's columns, [T, n] -> [T, d]
        if contiguous:
            self.down: PackedLinear = load_linear(f, [(layer_tensor(layer, "ffn_down"), None)], cols=(start, stop))
        else:
            self.down = self._gathered_down(f, layer, np.asarray(neurons, dtype=np.int64))

    @staticmethod
    def _gathered_down(f: GGUFFile, layer: int, neurons: np.ndarray) -> PackedLinear:
        cols, absmax = down_columns(f, layer, neurons)  # float32 [d, n], [d]
        # int8 with the full rows' scales: exact for an int8 matrix (Q6_K), else a requantization
        # (<= 0.4% of a row's range); bf16 would be exact for 4-bit files but torch's CPU bf16
        # matmul is ~50x slower than its int8 kernel (measured 16 ms vs 0.3 ms per SmolLM2 layer)
        packer = Int8Packer(cols.shape[0], cols.shape[1])
        packer.add(cols, absmax)
        return packer.finish()

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def hidden(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(act(gate), the hidden state act(gate) * up) [T, n] of normed x [T, d] (OPT: act(up + b) twice)."""
        return ffn_hidden(self.gate_up(x), self.cfg, self.bias)  # gate_up: [T, 2n] (OPT: [T, n])

    def forward(self, x: torch.Tensor, resid: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, d] (already normed) -> partial output [T, d] (resid: for sparse shards' predictors)."""
        return self.down(self.hidden(x)[1])


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
