"""Model configuration built from a GGUF file's own metadata (never from flags).

Runs in: the coordinator and every worker process.

Each supported architecture maps its ``{arch}.*`` keys onto one frozen :class:`ModelConfig`.
Settings llama.cpp hard-codes because converted files lack them (Gemma 3's sliding-window
pattern and local rope base, its query scale) are hard-coded here too, with the reason.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from powerinfer.errors import InvalidArgumentError, ModelFileError, UnsupportedModelError, quoted
from powerinfer.gguf_file import GGUFFile

# bamboo: PowerInfer's llama-shaped dReLU model; opt: Meta's OPT as PowerInfer's llama.cpp defines it
# (LayerNorm, biases everywhere, learned positions, a two-matrix ReLU MLP)
log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3", "bamboo", "opt")
# OPT's learned position table starts two rows in (HF's OPTLearnedPositionalEmbedding offset, which
# PowerInfer's llama.cpp adds to every position); its converter writes the whole table.
OPT_POSITION_OFFSET = 2

RopeStyle = Literal["norm", "neox"]
# The gated FFN's activation, h = act(gate) * up: SiLU (llama, qwen2), GELU's tanh form (gemma3),
# ReLU (ReGLU: ReluLLaMA, ReluFalcon), FATReLU (ProSparse: gate where gate > t, else 0), dReLU
# (Bamboo, TurboSparse: relu(gate) * relu(up)).
Activation = Literal["silu", "gelu_tanh", "relu", "fatrelu", "drelu"]
ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_tanh", "relu", "fatrelu", "drelu")
# Their codes in the C kernels (native/kernels/act.h) and the CUDA kernels (ffn_ops.cu):
# FATReLU is ReLU with a threshold (ReLU's is 0).
ACT_CODES: dict[str, int] = {"silu": 0, "gelu_tanh": 1, "relu": 2, "fatrelu": 2, "drelu": 3}
# Our metadata keys for a file's activation (docs/powerinfer-models.md): a string of ACTIVATIONS and
# FATReLU's float32 threshold. Files without them get their architecture's activation.
ACTIVATION_KEY = "powerinfer.ffn_activation"
ACTIVATION_THRESHOLD_KEY = "powerinfer.ffn_activation_threshold"


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    name: str
    n_layers: int
    d_model: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # per-head width of q and k
    v_head_dim: int  # per-head width of v
    vocab_size: int
    context_length: int  # the training context; the runtime context (-c) may be smaller
    norm_eps: float
    rope_dim: int  # leading dims of each head that are rotated
    rope_base: float  # for global-attention layers
    rope_base_local: float  # for sliding-window layers
    rope_scale: float  # position multiplier (1 / linear scaling factor) on global layers
    rope_style: RopeStyle
    activation: Activation
    qkv_bias: bool
    qk_norm: bool
    post_norms: bool  # Gemma's extra norms after attention and after the FFN
    embed_scale: float  # embeddings are multiplied by this (Gemma: sqrt(d_model))
    attn_scale: float  # softmax(q.k * attn_scale)
    sliding_window: int  # 0: none
    global_layers: tuple[bool, ...]  # per layer: True = full attention, False = sliding window
    tied_embeddings: bool
    final_logit_softcap: float  # 0: none
    act_threshold: float = 0.0  # FATReLU's t (activation "fatrelu"); 0 for every other activation
    norm: Literal["rms", "layer"] = "rms"  # RMSNorm, or LayerNorm with a bias (OPT)
    gated_ffn: bool = True  # act(gate) * up; False: OPT's act(up + b_up), the only matrix before down
    proj_bias: bool = False  # biases on the attention output, the FFN's first matrix and down (OPT)
    learned_pos: bool = False  # position_embd.weight row pos + pos_offset added to the embeddings (OPT); no rope
    pos_offset: int = 0

    @property
    def gate_part(self) -> str:
        """The tensor whose activation decides a neuron: ffn_gate, or OPT's ffn_up (fc1)."""
        return "ffn_gate" if self.gated_ffn else "ffn_up"

    @property
    def ffn_parts(self) -> tuple[str, ...]:
        """The FFN's matrices before down, in the order the hidden state uses them: (gate, up) or (up,)."""
        return ("ffn_gate", "ffn_up") if self.gated_ffn else ("ffn_up",)

    @property
    def gqa_group(self) -> int:
        return self.n_heads // self.n_kv_heads

    def layer_rope(self, layer: int) -> tuple[float, float]:
        """(base, position scale) that layer ``layer`` rotates with."""
        if self.global_layers[layer]:
            return self.rope_base, self.rope_scale
        return self.rope_base_local, 1.0


def check_context(cfg: ModelConfig, n_ctx: int) -> None:
    """A runtime context past the model's training context: a warning, or an error where positions
    come from a learned table (OPT) that has no row for them."""
    if n_ctx <= cfg.context_length:
        return
    if cfg.learned_pos:
        raise InvalidArgumentError(f"context size {n_ctx} exceeds the {cfg.context_length} positions of this {cfg.arch} model "
                                   "(its position table ends there; give a smaller -c)")
    log.warning("context %d exceeds the %d the model was trained with", n_ctx, cfg.context_length)


def _int(f: GGUFFile, key: str, default: int | None = None) -> int:
    if key not in f.metadata and default is not None:
        return default
    value = f.require(key, int)
    if value <= 0:
        raise ModelFileError(f"{f.path}: metadata {key!r} must be positive, got {value}")
    return int(value)


def _float(f: GGUFFile, key: str, default: float) -> float:
    if key not in f.metadata:
        return default
    value = f.require(key, (int, float))
    if not math.isfinite(value):
        raise ModelFileError(f"{f.path}: metadata {key!r} is not finite")
    return float(value)


def _per_layer(f: GGUFFile, key: str, n_layers: int, default: int | None = None) -> int:
    """Head counts may be stored per layer (an array); we support only uniform ones."""
    value = f.metadata.get(key)
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu":  # a float array would truncate (or fail on NaN) in int()
            raise ModelFileError(f"{f.path}: metadata {key!r} is an array of {value.dtype}, expected integers")
        if value.size != n_layers or len(set(value.tolist())) != 1:
            raise UnsupportedModelError(f"{f.path}: per-layer {key} {quoted(value.tolist())} is not supported")
        value = int(value[0])
        if value <= 0:
            raise ModelFileError(f"{f.path}: metadata {key!r} must be positive")
        return value
    return _int(f, key, default)


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    arch = f.require("general.architecture", str)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{f.path}: architecture {quoted(arch)} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    n_layers = _int(f, f"{arch}.block_count")
    # Every layer has tensors: a larger count is a corrupt file, and per-layer tuples below (and the
    # engine's per-layer state) must not be sized by it (a uint32 max would be billions of entries).
    if n_layers > len(f.tensors):
        raise ModelFileError(f"{f.path}: {arch}.block_count is {n_layers}, but the file has only {len(f.tensors)} tensors")
    d_model = _int(f, f"{arch}.embedding_length")
    n_ff = _per_layer(f, f"{arch}.feed_forward_length", n_layers)
    n_heads = _per_layer(f, f"{arch}.attention.head_count", n_layers)
    n_kv_heads = _per_layer(f, f"{arch}.attention.head_count_kv", n_layers, default=n_heads)
    if n_heads % n_kv_heads:
        raise ModelFileError(f"{f.path}: {n_heads} heads is not a multiple of {n_kv_heads} kv heads")
    if n_heads > d_model and f"{arch}.attention.key_length" not in f.metadata:
        # the default head size d_model // n_heads would be 0 (and attn_scale 1 / sqrt(0))
        raise ModelFileError(f"{f.path}: {n_heads} attention heads do not fit the model width {d_model}")
    head_dim = _int(f, f"{arch}.attention.key_length", d_model // n_heads)
    v_head_dim = _int(f, f"{arch}.attention.value_length", head_dim)
    rope_dim = 0 if arch == "opt" else _int(f, f"{arch}.rope.dimension_count", head_dim)
    if rope_dim > head_dim or rope_dim % 2:
        raise ModelFileError(f"{f.path}: rope dimension {rope_dim} does not fit head size {head_dim}")
    tokens = f.get("tokenizer.ggml.tokens")
    # len() only of an array: a scalar or string here is a corrupt file, reported by the tokenizer
    n_tokens = len(tokens) if isinstance(tokens, (list, np.ndarray)) and len(tokens) else None
    vocab_size = _int(f, f"{arch}.vocab_size", n_tokens)
    embd = f.tensor("token_embd.weight")
    if embd.shape != (vocab_size, d_model):
        raise ModelFileError(f"{f.path}: token_embd.weight has shape {list(embd.shape)}, expected [{vocab_size}, {d_model}]")
    rope_base = _float(f, f"{arch}.rope.freq_base", 10000.0)
    rope_scale = 1.0
    scaling = f.get(f"{arch}.rope.scaling.type", "none")
    if not isinstance(scaling, str):  # an array here made `scaling == "linear"` ambiguous (ValueError)
        raise ModelFileError(f"{f.path}: metadata {arch}.rope.scaling.type has type {type(scaling).__name__}, expected a string")
    if scaling == "linear":
        factor = _float(f, f"{arch}.rope.scaling.factor", 1.0)
        if factor <= 0:  # 1 / 0, or positions running backwards
            raise ModelFileError(f"{f.path}: metadata {arch}.rope.scaling.factor must be positive, got {factor}")
        rope_scale = 1.0 / factor
    elif scaling != "none":
        raise UnsupportedModelError(f"{f.path}: rope scaling {quoted(scaling)} is not supported")
    norm_eps = _float(f, f"{arch}.attention.layer_norm_epsilon" if arch == "opt" else f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    context_length = _int(f, f"{arch}.context_length", 2048)
    if arch == "opt":
        pos = f.tensor("position_embd.weight")
        if len(pos.shape) != 2 or pos.shape[1] != d_model or pos.shape[0] <= OPT_POSITION_OFFSET:
            raise ModelFileError(f"{f.path}: position_embd.weight has shape {list(pos.shape)}, expected [n_positions + "
                                 f"{OPT_POSITION_OFFSET}, {d_model}]")
        context_length = min(context_length, pos.shape[0] - OPT_POSITION_OFFSET)  # no position past the table
    activation, act_threshold = _activation(f, arch)
    sliding_window = 0
    global_layers = tuple(True for _ in range(n_layers))
    rope_base_local = rope_base
    if arch == "gemma3":
        # llama.cpp hard-codes these for Gemma 3 (the GGUF lacks them): every 6th layer (5, 11, 17,
        # ...) attends globally, the others use a sliding window with rope base 10000; queries are
        # scaled by 1/sqrt(head_dim) (the 27B model aside, which we do not special-case).
        sliding_window = _int(f, f"{arch}.attention.sliding_window", 512)
        global_layers = tuple(i % 6 == 5 for i in range(n_layers))
        rope_base_local = 10000.0
    return ModelConfig(
        arch=arch,
        name=str(f.get("general.name", f.path.stem)),
        n_layers=n_layers,
        d_model=d_model,
        n_ff=n_ff,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        vocab_size=vocab_size,
        context_length=context_length,
        norm_eps=norm_eps,
        rope_dim=rope_dim,
        rope_base=rope_base,
        rope_base_local=rope_base_local,
        rope_scale=rope_scale,
        # llama's converter permutes q/k rows so ggml's adjacent-pair rope matches HF; qwen2 and
        # gemma are stored unpermuted and rotate halves (GPT-NeoX style).
        rope_style="norm" if arch in ("llama", "bamboo") else "neox",
        activation=activation,
        qkv_bias=arch in ("qwen2", "opt"),
        qk_norm=arch == "gemma3",
        post_norms=arch == "gemma3",
        embed_scale=math.sqrt(d_model) if arch == "gemma3" else 1.0,
        attn_scale=1.0 / math.sqrt(head_dim),
        sliding_window=sliding_window,
        global_layers=global_layers,
        tied_embeddings="output.weight" not in f.tensors,
        final_logit_softcap=_float(f, f"{arch}.final_logit_softcapping", 0.0),
        act_threshold=act_threshold,
        norm="layer" if arch == "opt" else "rms",
        gated_ffn=arch != "opt",
        proj_bias=arch == "opt",
        learned_pos=arch == "opt",
        pos_offset=OPT_POSITION_OFFSET if arch == "opt" else 0,
    )


def _activation(f: GGUFFile, arch: str) -> tuple[Activation, float]:
    """The file's FFN activation and FATReLU threshold: our key when present, else the architecture's own."""
    kind = f.get(ACTIVATION_KEY)
    if kind is None:
        return ("gelu_tanh" if arch == "gemma3" else "drelu" if arch == "bamboo" else "relu" if arch == "opt" else "silu"), 0.0
    if not isinstance(kind, str) or kind not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"{f.path}: FFN activation {quoted(kind)} ({ACTIVATION_KEY}) is not supported (supported: {', '.join(ACTIVATIONS)})"
        )
    threshold = _float(f, ACTIVATION_THRESHOLD_KEY, 0.0)
    if arch == "opt" and kind not in ("relu", "fatrelu"):  # dReLU needs an up matrix OPT does not have
        raise UnsupportedModelError(f"{f.path}: FFN activation {quoted(kind)} does not fit OPT's two-matrix MLP (relu or fatrelu)")
    if threshold and kind != "fatrelu":
        raise ModelFileError(f"{f.path}: {ACTIVATION_THRESHOLD_KEY} is {threshold}, but only fatrelu has a threshold (activation {kind})")
    return kind, threshold  # type: ignore[return-value]
