"""Planted-sparsity llama GGUFs: standard ``llama`` files whose FFNs behave like ReLU-fied models.

Runs in: tools and tests (the CLI process or pytest); ``powerinfer synth`` (cli/synth_cmd.py).

Published ReLU-fied llamas (ProSparse-7B) leave ~89% of FFN neurons inactive per token, and the
activity is skewed: a hot minority fires for most tokens and carries most of the mass. We cannot
download such models at every size, so this writes random ones with that behaviour *planted*, as
plain llama files (SiLU gate, tied embeddings, no extra tensors) that llama.cpp runs unchanged.
With ``act`` "relu" or "drelu" the file says so (``powerinfer.ffn_activation``, which llama.cpp
ignores: it runs the same bytes with SiLU, a fair clock) and ReGLU's exact zeros replace SiLU's
near-zeros; with ``gate_rank`` r > 0 the firing is learnable (below).

The plant. A random unit "bias direction" b (dense, so Q4_0 blocks stay well conditioned):
  * every embedding row is sqrt(d) * (s0 * b + sqrt(1 - s0^2) * r_t) with r_t a unit vector
    orthogonal to b, and attn_output / ffn_down are projected off b (W <- W - b b^T W), so the
    residual's b-component x.b is the same positive constant for every token at every layer; norm
    weights are ones, so c_t = h_t.b > 0 for the normed FFN input h_t of every token;
  * gate row j is kappa_j * (z_j - beta_j * b) with z_j random orthogonal to b, so
    g_j = kappa_j * (z_j.h - beta_j * c_t) and neuron j fires iff (z_j.h) / c_t > beta_j: beta_j is
    a per-neuron threshold and kappa_j a gain. SiLU is not ReLU, so the gain is large (std of g
    over tokens = ``gate_scale``): most inactive neurons sit below g = -gate_scale (silu ~ -2e-6).
  * learnable firing (``gate_rank`` r > 0): the z_j of a layer lie in one random r-dimensional
    subspace Q (orthogonal to b) up to a ``rank_noise`` share of their norm, z_j = a_j Q + e_j, so
    whether neuron j fires is a function of (Q h, h.b) up to that noise: a predictor of rank >= r
    (fc2(relu(fc1 h)), PowerInfer's shape) can learn it, as real ReLU models' predictors do. With
    r = 0 every z_j is random in R^d and only the full gate matmul knows which neurons fire.
  * dReLU (relu(gate) * relu(up)): the up rows are planted the same way, with their own directions
    in the same subspace, and gate and up each fire with probability sqrt(p_j), so both do ~p_j.
  * each layer draws firing probabilities p_j (mean 1 - inactive_fraction) from a log-normal
    clipped at 0.95 whose spread is solved so that the top ``hot_fraction`` neurons take
    ``hot_share`` of all firings; neurons are shuffled so hot ones are scattered as in real models.
  * calibration, not assumption: while writing, a batch of random token sequences is run through
    the layers written so far (real causal attention with rope, the real FFNs, float32 weights
    before quantization); at each layer the ratios (z_j.h)/c_t over those tokens give a mean and a
    std per neuron, and beta_j = mean + std * Phi^-1(1 - p_j). The attention and FFN outputs are
    rescaled so each adds ``branch_scale`` of the embeddings' random-part rms to the residual.
:func:`measure_sparsity` then runs the file's own (dequantized) layers on fresh tokens and reports
what the neurons actually do; it is independent of the plan except for sharing the forward code.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from tqdm import tqdm

from powerinfer.config import ACTIVATION_KEY
from powerinfer.errors import InvalidArgumentError
from powerinfer.model.reference import activation, up_value
from powerinfer.synthetic import byte_vocab

log = logging.getLogger(__name__)
QT = GGMLQuantizationType

# The planter's forward building blocks (float32, on the weights it is writing; the finished file is
# measured through the readable model, powerinfer/model/reference.py, which the tests hold these to).
ROPE_BASE, NORM_EPS = 10000.0, 1e-5


def rms_norm(x: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + NORM_EPS)
    return y if w is None else y * w


def _rope(x: np.ndarray) -> np.ndarray:
    """llama ("norm") rope on adjacent pairs, as ggml does for llama files. x [B, T, H, D]."""
    d = x.shape[-1]
    ang = np.arange(x.shape[1])[:, None] * ROPE_BASE ** (-np.arange(0, d, 2) / d)  # [T, D/2]
    c, s = np.cos(ang).astype(np.float32)[None, :, None], np.sin(ang).astype(np.float32)[None, :, None]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


def attention(h: np.ndarray, wq: np.ndarray, wk: np.ndarray, wv: np.ndarray, n_heads: int, n_kv: int) -> np.ndarray:
    """Causal GQA attention of normed h [B, T, d] -> per-head outputs concatenated [B, T, n_heads*hd]
    (before attn_output)."""
    B, T, _ = h.shape
    hd = wq.shape[0] // n_heads
    q = _rope((h @ wq.T).reshape(B, T, n_heads, hd)).transpose(0, 2, 1, 3)  # [B, H, T, hd]
    k = _rope((h @ wk.T).reshape(B, T, n_kv, hd)).transpose(0, 2, 3, 1)  # [B, KV, hd, T]
    v = (h @ wv.T).reshape(B, T, n_kv, hd).transpose(0, 2, 1, 3)  # [B, KV, T, hd]
    g = n_heads // n_kv
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = (q @ k) / np.float32(math.sqrt(hd)) + np.triu(np.full((T, T), -np.inf, np.float32), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ v).transpose(0, 2, 1, 3).reshape(B, T, n_heads * hd)


WRITABLE_TYPES = (QT.F32, QT.F16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1)
SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(n_layers=2, d_model=128, n_ff=512, n_heads=4, n_kv_heads=2, context_length=256),
    "tinyllama-1.1b": dict(n_layers=22, d_model=2048, n_ff=5632, n_heads=32, n_kv_heads=4, context_length=2048),
    "llama2-7b": dict(n_layers=32, d_model=4096, n_ff=11008, n_heads=32, n_kv_heads=32, context_length=4096),
}
P_MAX = 0.95  # no neuron fires for every token
PLANTED_ACTS = ("silu", "relu", "drelu")
QUANT_CHUNK_ROWS = 1024  # rows quantized at a time: bounds gguf.quants' float64 temporaries


@dataclass(frozen=True)
class ReluSparseSpec:
    n_layers: int
    d_model: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    vocab: int = 259  # byte-level: 256 bytes, <s>, </s> and the merged "ĠĠ" (see _vocab); more adds unused tokens
    context_length: int = 2048
    qtype: GGMLQuantizationType = QT.Q4_0  # the 2-D matrices; embeddings are Q8_0 (or qtype if float)
    inactive_fraction: float = 0.89  # target share of FFN neurons with g < 0 per token
    hot_fraction: float = 0.2  # share of neurons that are "hot"
    hot_share: float = 0.8  # share of all firings that fall on the hot neurons (PowerInfer: ~80%)
    gate_scale: float = 16.0  # std of each gate pre-activation over tokens
    bias_share: float = 0.5  # cosine between an embedding row and the bias direction
    branch_scale: float = 0.35  # rms of each attention / FFN output over the embeddings' random-part rms
    calib_tokens: int = 256  # tokens (in sequences of 64) run through the model to calibrate
    seed: int = 0
    act: str = "silu"  # the FFN activation the file declares: silu (a plain llama file), relu (ReGLU), drelu
    gate_rank: int = 0  # > 0: gate (and dReLU's up) directions in a subspace of this rank: learnable firing
    rank_noise: float = 0.1  # share of each direction's norm outside that subspace
    logit_std: float = 0.0  # > 0: output_norm scaled so the logits' spread over the vocabulary is about this

    def __post_init__(self) -> None:
        block, mean = GGML_QUANT_SIZES[self.qtype][0], 1.0 - self.inactive_fraction
        problems = [
            (min(self.n_layers, self.d_model, self.n_ff, self.n_heads, self.n_kv_heads, self.calib_tokens) <= 0,
             "layer, width, head and token counts must be positive"),
            (self.d_model % self.n_heads > 0 or self.n_heads % self.n_kv_heads > 0 or self.d_model // self.n_heads % 2 > 0,
             f"{self.n_heads} heads / {self.n_kv_heads} kv heads do not fit d_model {self.d_model}"),
            (self.qtype not in WRITABLE_TYPES, f"qtype {self.qtype.name} is not one of {[t.name for t in WRITABLE_TYPES]}"),
            (self.d_model % block > 0 or self.n_ff % block > 0, f"d_model, n_ff must be multiples of {self.qtype.name}'s {block}"),
            (self.vocab < 259, f"vocab must hold the 259 byte-level tokens, got {self.vocab}"),
            (not (0 < mean < P_MAX and 0 < self.hot_fraction < 1 and 0 < self.hot_share < 1),
             "inactive_fraction, hot_fraction and hot_share must lie in (0, 1)"),
            (self.hot_share < self.hot_fraction or self.hot_fraction * P_MAX < self.hot_share * mean,
             f"hot_share {self.hot_share} is unreachable with hot_fraction {self.hot_fraction}"),
            (not (0.05 <= self.bias_share <= 0.95 and self.gate_scale > 0 and self.branch_scale > 0),
             "bias_share must lie in [0.05, 0.95], gate_scale and branch_scale be positive"),
            (self.act not in PLANTED_ACTS, f"act must be one of {', '.join(PLANTED_ACTS)}, got {self.act!r}"),
            (not 0 <= self.gate_rank < self.d_model or not 0 <= self.rank_noise < 1,
             f"gate_rank must lie in [0, d_model) and rank_noise in [0, 1), got {self.gate_rank}, {self.rank_noise}"),
        ]
        for bad, message in problems:
            if bad:
                raise InvalidArgumentError(message)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def embd_type(self) -> GGMLQuantizationType:
        return self.qtype if self.qtype in (QT.F32, QT.F16) else QT.Q8_0

    @classmethod
    def shape(cls, name: str, **kw: Any) -> "ReluSparseSpec":
        """A named shape ("tiny", "tinyllama-1.1b", "llama2-7b"); ``kw`` overrides any field."""
        if name not in SHAPES:
            raise InvalidArgumentError(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
        return cls(**{**SHAPES[name], **kw})


# -- the forward pass shared by calibration and measurement (float32 numpy) -------------------------


def firing_probabilities(n: int, mean: float, hot_fraction: float, hot_share: float) -> np.ndarray:
    """Per-neuron firing probabilities, sorted descending: log-normal quantiles clipped at P_MAX,
    with mean ``mean`` and the top ``hot_fraction`` of neurons taking ``hot_share`` of the sum."""
    nd = statistics.NormalDist()
    z = np.array([nd.inv_cdf((i + 0.5) / n) for i in range(n)])[::-1]  # descending standard normal quantiles
    n_hot = max(1, round(hot_fraction * n))

    def probs(sigma: float) -> np.ndarray:
        lo, hi = -60.0, 10.0  # mean(min(P_MAX, exp(mu + sigma z))) grows with mu: bisect it
        for _ in range(100):
            mu = 0.5 * (lo + hi)
            lo, hi = (mu, hi) if np.minimum(P_MAX, np.exp(mu + sigma * z)).mean() < mean else (lo, mu)
        return np.minimum(P_MAX, np.exp(0.5 * (lo + hi) + sigma * z))

    lo, hi = 0.0, 8.0  # the hot share grows with sigma
    for _ in range(60):
        sigma = 0.5 * (lo + hi)
        p = probs(sigma)
        lo, hi = (sigma, hi) if p[:n_hot].sum() / p.sum() < hot_share else (lo, sigma)
    return probs(0.5 * (lo + hi))


def _tensor_plan(spec: ReluSparseSpec) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """(name, numpy shape, type) in file order, which is also generation order; norms are 1-D."""
    d, f, kv = spec.d_model, spec.n_ff, spec.n_kv_heads * spec.head_dim
    plan = [("token_embd.weight", (spec.vocab, d), spec.embd_type), ("output_norm.weight", (d,), QT.F32)]
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", (d,), QT.F32), (p + "attn_q.weight", (d, d), spec.qtype),
                 (p + "attn_k.weight", (kv, d), spec.qtype), (p + "attn_v.weight", (kv, d), spec.qtype),
                 (p + "attn_output.weight", (d, d), spec.qtype), (p + "ffn_norm.weight", (d,), QT.F32),
                 (p + "ffn_gate.weight", (f, d), spec.qtype), (p + "ffn_up.weight", (f, d), spec.qtype),
                 (p + "ffn_down.weight", (d, f), spec.qtype)]
    return plan


def _encode(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 [rows, cols] (or [n]) -> the bytes (or floats) stored in the file, quantized by row chunks."""
    if qtype == QT.F32:
        return np.ascontiguousarray(x, np.float32)
    if qtype == QT.F16:
        return x.astype(np.float16)
    block, size = GGML_QUANT_SIZES[qtype]
    out = np.empty((x.shape[0], x.shape[1] // block * size), np.uint8)
    for r in range(0, x.shape[0], QUANT_CHUNK_ROWS):
        out[r : r + QUANT_CHUNK_ROWS] = quantize(x[r : r + QUANT_CHUNK_ROWS], qtype)
    return out


class _Planter:
    """Generates the tensors in file order while running the calibration tokens through them."""

    def __init__(self, spec: ReluSparseSpec) -> None:
        self.spec = spec
        d = spec.d_model
        b = self._rng("bias").standard_normal(d)
        self.b = (b / np.linalg.norm(b)).astype(np.float32)  # the bias direction, unit [d]
        self.p_sorted = firing_probabilities(spec.n_ff, 1.0 - spec.inactive_fraction, spec.hot_fraction, spec.hot_share)
        self.target_rms = spec.branch_scale * math.sqrt(1.0 - spec.bias_share**2)  # branch outputs' rms
        n_seq = max(1, -(-spec.calib_tokens // 64))
        self.ids = self._rng("calib").integers(0, 256, (n_seq, min(64, spec.calib_tokens)))
        self.ids[:, 0] = 256  # <s> opens each sequence, as the runtime does
        self.x: np.ndarray | None = None  # calibration residual stream [B, T, d]

    def _rng(self, *key: str | int) -> np.random.Generator:
        words = [self.spec.seed] + [k if isinstance(k, int) else int.from_bytes(k.encode()[:8], "little") for k in key]
        return np.random.default_rng(words)

    def _off_b(self, w: np.ndarray) -> np.ndarray:
        """Project the *outputs* of w [d, k] off b so the branch never moves the residual along b."""
        return w - np.outer(self.b, self.b @ w)

    def _branch(self, w: np.ndarray, inp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Scale output projection w [d, k] so inp [..., k] @ w.T has the target rms; -> (w, output)."""
        out = inp @ w.T
        s = np.float32(self.target_rms / math.sqrt(float((out * out).mean())))
        return w * s, out * s

    def embeddings(self) -> np.ndarray:
        s, d = self.spec, self.spec.d_model
        r = self._rng("embd").standard_normal((s.vocab, d), np.float32)
        r -= np.outer(r @ self.b, self.b)
        r /= np.linalg.norm(r, axis=1, keepdims=True)
        e = math.sqrt(d) * (s.bias_share * self.b + math.sqrt(1.0 - s.bias_share**2) * r)  # rms 1 per row
        self.x = e[self.ids].astype(np.float32)
        return e.astype(np.float32)

    def layer(self, i: int) -> Iterator[tuple[str, np.ndarray]]:
        s, d, f, x = self.spec, self.spec.d_model, self.spec.n_ff, self.x
        assert x is not None, "embeddings() first"
        p, rng = f"blk.{i}.", self._rng("layer", i)
        ones = np.ones(d, np.float32)
        wq, wk, wv = (rng.standard_normal((r, d), np.float32) / np.float32(math.sqrt(d))
                      for r in (d, s.n_kv_heads * s.head_dim, s.n_kv_heads * s.head_dim))
        att = attention(rms_norm(x), wq, wk, wv, s.n_heads, s.n_kv_heads)
        wo, att_out = self._branch(self._off_b(rng.standard_normal((d, d), np.float32)), att)
        yield from ((p + "attn_norm.weight", ones), (p + "attn_q.weight", wq), (p + "attn_k.weight", wk),
                    (p + "attn_v.weight", wv), (p + "attn_output.weight", wo), (p + "ffn_norm.weight", ones))
        del wq, wk, wv, wo
        x = x + att_out
        h = rms_norm(x).reshape(-1, d)  # [N, d]
        c = h @ self.b  # [N] the shared bias component; positive by construction
        if c.min() <= 0:
            raise RuntimeError(f"layer {i}: the bias direction lost its sign; lower branch_scale")
        basis = self._subspace(rng)
        wg, gate, prob = self._switches(rng, basis, h, c)
        log.debug("layer %d: calibration share of g < 0: %.3f", i, float((gate < 0).mean()))
        yield p + "ffn_gate.weight", wg
        del wg
        if s.act == "drelu":
            wu, up, _ = self._switches(rng, basis, h, c, prob)
        else:
            wu = rng.standard_normal((f, d), np.float32) / np.float32(math.sqrt(d))
            up = h @ wu.T
        act = activation(gate, s.act) * up_value(up, s.act)
        yield p + "ffn_up.weight", wu
        del wu
        wd, ffn_out = self._branch(self._off_b(rng.standard_normal((d, f), np.float32)), act)
        yield p + "ffn_down.weight", wd
        self.x = x + ffn_out.reshape(x.shape)

    def _subspace(self, rng: np.random.Generator) -> np.ndarray | None:
        """A layer's orthonormal basis [r, d] of the learnable directions, orthogonal to b (None: r = 0)."""
        if self.spec.gate_rank == 0:
            return None
        q = rng.standard_normal((self.spec.gate_rank, self.spec.d_model))
        q -= np.outer(q @ self.b, self.b)
        return np.linalg.qr(q.T)[0].T.astype(np.float32)

    def _switches(self, rng: np.random.Generator, basis: np.ndarray | None, h: np.ndarray, c: np.ndarray,
                  prob: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows [f, d] that fire (> 0) with probability prob[j] on the calibration tokens' normed FFN
        inputs h [N, d] (c = h.b [N]), their pre-activations [N, f] and prob [f] (drawn when None)."""
        s, f, d = self.spec, self.spec.n_ff, self.spec.d_model
        z = rng.standard_normal((f, d), np.float32)
        if basis is not None:  # a_j Q with a rank_noise share of z_j's own direction
            low = rng.standard_normal((f, s.gate_rank), np.float32) @ basis
            low /= np.linalg.norm(low, axis=1, keepdims=True)
            z /= np.linalg.norm(z, axis=1, keepdims=True)
            z = np.float32(math.sqrt(1.0 - s.rank_noise**2)) * low + np.float32(s.rank_noise) * z
        z -= np.outer(z @ self.b, self.b)
        proj = h @ z.T  # [N, f]
        ratio = proj / c[:, None]
        if prob is None:
            prob = rng.permutation(self.p_sorted)  # hot neurons scattered over the layer
            if s.act == "drelu":  # gate and up each fire with sqrt(p): together ~p (independent directions)
                prob = np.sqrt(prob)
        nd = statistics.NormalDist()
        q = np.array([nd.inv_cdf(1.0 - pj) for pj in prob], np.float32)
        beta = ratio.mean(0) + ratio.std(0) * q  # neuron j fires iff (z_j.h)/c > beta_j
        pre = proj - beta[None, :] * c[:, None]
        kappa = np.float32(s.gate_scale) / pre.std(0)
        return kappa[:, None] * (z - beta[:, None] * self.b[None, :]), pre * kappa, prob

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        yield "token_embd.weight", self.embeddings()
        # Tied rows of norm sqrt(d) against a normed state of norm sqrt(d): logits spread ~sqrt(d) apart,
        # a distribution no trained model has (perplexities ~1e17); logit_std scales them to a real one's.
        scale = 1.0 if self.spec.logit_std <= 0 else self.spec.logit_std / math.sqrt(self.spec.d_model)
        yield "output_norm.weight", np.full(self.spec.d_model, scale, np.float32)
        for i in range(self.spec.n_layers):
            yield from self.layer(i)


def _vocab(n: int) -> tuple[list[str], list[int], list[str]]:
    """Byte-level gpt2 vocabulary (tokens, types, merges) of n >= 259 tokens. llama.cpp refuses a
    gpt2 tokenizer without a merges key and gguf cannot write an empty array, so one real merge
    (two spaces, "ĠĠ", id 258) is added; ids above it are unused control tokens."""
    tokens, types = byte_vocab()  # 256 bytes, <s> = 256, </s> = 257
    tokens, types = tokens + ["\u0120\u0120"], types + [1]
    return tokens + [f"<unused{i}>" for i in range(n - 259)], types + [3] * (n - 259), ["\u0120 \u0120"]


def write_relu_sparse_gguf(path: str | Path, spec: ReluSparseSpec, progress: bool = False) -> Path:
    """Write the planted model to ``path``, one tensor at a time (the header first, from the plan)."""
    path = Path(path)
    t0 = time.perf_counter()
    tokens, types, merges = _vocab(spec.vocab)
    w = GGUFWriter(str(path), "llama")
    w.add_name(f"{spec.act}-sparse-llama-{spec.n_layers}x{spec.d_model}")
    w.add_description(f"planted FFN sparsity {spec.inactive_fraction}, hot {spec.hot_fraction}/{spec.hot_share}, "
                      f"gate rank {spec.gate_rank or 'full'}, seed {spec.seed}")
    if spec.act != "silu":
        w.add_string(ACTIVATION_KEY, spec.act)
    for add, value in ((w.add_block_count, spec.n_layers), (w.add_context_length, spec.context_length),
                       (w.add_embedding_length, spec.d_model), (w.add_feed_forward_length, spec.n_ff),
                       (w.add_head_count, spec.n_heads), (w.add_head_count_kv, spec.n_kv_heads),
                       (w.add_rope_dimension_count, spec.head_dim), (w.add_rope_freq_base, ROPE_BASE),
                       (w.add_layer_norm_rms_eps, NORM_EPS), (w.add_vocab_size, spec.vocab),
                       (w.add_tokenizer_model, "gpt2"), (w.add_tokenizer_pre, "default"), (w.add_token_list, tokens),
                       (w.add_token_types, types), (w.add_token_merges, merges), (w.add_bos_token_id, 256),
                       (w.add_eos_token_id, 257), (w.add_add_bos_token, True)):
        add(value)  # type: ignore[operator]
    if spec.qtype not in (QT.F32, QT.F16):
        w.add_quantization_version(2)
    plan = _tensor_plan(spec)
    for name, shape, qt in plan:
        block, size = GGML_QUANT_SIZES[qt]
        # float32 as the nominal dtype keeps gguf from reading ``shape`` as a byte shape.
        w.add_tensor_info(name, shape, np.dtype(np.float32), math.prod(shape) // block * size, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    try:
        tensors = zip(plan, _Planter(spec).tensors(), strict=True)
        for (name, _, qt), (got, data) in tqdm(tensors, total=len(plan), desc="tensors", unit="t", disable=not progress):
            assert name == got, (name, got)
            w.write_tensor_data(_encode(data, qt))
    finally:
        w.close()
    log.info("wrote %s (%.1f MB) in %.1fs", path, path.stat().st_size / 1e6, time.perf_counter() - t0)
    return path
