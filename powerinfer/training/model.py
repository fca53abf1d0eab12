"""A llama-shaped decoder in plain torch, with Hugging Face's parameter names and semantics, for training.

Runs in: the CLI process (``powerinfer train-relu``).

Its state dict is a ``LlamaForCausalLM`` checkpoint (``model.layers.N.self_attn.q_proj.weight``...,
rotate-half rope, RMSNorm in float32), so ``powerinfer convert`` turns it into GGUF and the tests
hold its forward pass to transformers'. The FFN activation is any of config.py's: ``silu``,
``relu`` (ReGLU), ``fatrelu`` (threshold t), ``drelu`` (relu(gate) * relu(up)).

    x = embed(ids)                                                  [B, T, d]
    per layer: x += o(attn(rope(q(n1 x)), rope(k(n1 x)), v(n1 x)))  n: RMSNorm, causal, GQA
               x += down(act(gate(n2 x)) * up(n2 x))
    logits = n(x) embed^T (tied)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TinyLlamaConfig:
    vocab: int
    d: int
    layers: int
    heads: int
    kv_heads: int
    n_ff: int
    activation: str = "relu"
    act_threshold: float = 0.0
    rope_theta: float = 10000.0
    eps: float = 1e-5
    context: int = 512

    def hf_config(self) -> dict[str, object]:
        """config.json for the checkpoint (model_type bamboo for dReLU, ProSparse's keys for FATReLU)."""
        cfg: dict[str, object] = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": self.vocab, "hidden_size": self.d,
            "intermediate_size": self.n_ff, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "hidden_act": "relu" if self.activation == "drelu" else self.activation,
            "rms_norm_eps": self.eps, "rope_theta": self.rope_theta, "max_position_embeddings": self.context,
            "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32"}
        if self.activation == "drelu":
            cfg.update(model_type="bamboo", architectures=["BambooForCausalLM"])
        if self.activation == "fatrelu":
            cfg["hidden_act_param"] = self.act_threshold
        return cfg


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: TinyLlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = c.heads, c.kv_heads, c.d // c.heads
        self.q_proj = nn.Linear(c.d, c.heads * self.hd, bias=False)
        self.k_proj = nn.Linear(c.d, c.kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(c.d, c.kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(c.heads * self.hd, c.d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.hd).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        g = self.heads // self.kv_heads
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale 1/sqrt(D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: TinyLlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.d, c.n_ff, bias=False)
        self.up_proj = nn.Linear(c.d, c.n_ff, bias=False)
        self.down_proj = nn.Linear(c.n_ff, c.d, bias=False)
        self.act, self.t = c.activation, c.act_threshold

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The FFN's hidden state [.., n_ff]: the neurons whose zeros sparsity skips."""
        g, u = self.gate_proj(x), self.up_proj(x)
        if self.act == "silu":
            return F.silu(g) * u
        if self.act == "fatrelu":
            return F.threshold(g, self.t, 0.0) * u
        if self.act == "drelu":
            return F.relu(g) * F.relu(u)
        return F.relu(g) * u

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden(x))


class Layer(nn.Module):
    def __init__(self, c: TinyLlamaConfig) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(c.d, c.eps), RMSNorm(c.d, c.eps)
        self.self_attn, self.mlp = Attention(c), MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(nn.Module):
    def __init__(self, c: TinyLlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab, c.d)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.d, c.eps)


class TinyLlama(nn.Module):
    """``model.*`` is the decoder; the head is tied to the embeddings (no lm_head parameter)."""

    def __init__(self, c: TinyLlamaConfig) -> None:
        super().__init__()
        self.config = c
        self.model = Inner(c)
        hd = c.d // c.heads
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = torch.arange(c.context, dtype=torch.float64)[:, None] * inv[None, :]  # [ctx, D/2]
        emb = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            if p.ndim == 2:
                nn.init.normal_(p, 0.0, 0.02)
                if name.endswith(("o_proj.weight", "down_proj.weight")):  # residual branches scaled by depth (GPT-2)
                    p.data /= (2 * self.config.layers) ** 0.5

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, vocab]."""
        T = ids.shape[1]
        x = self.model.embed_tokens(ids)
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x) @ self.model.embed_tokens.weight.T.to(x.dtype)
