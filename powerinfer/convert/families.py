"""Each Hugging Face model family as GGUF: its architecture, metadata and tensors.

Runs in: the CLI process (``powerinfer convert``).

Families (``config.json``'s ``model_type``):

* ``llama``, ``mistral``: llama.cpp's ``llama`` layout. q and k rows are permuted per head the way
  llama.cpp's converter does (HF rotates halves; ggml's rope mode 0 rotates adjacent pairs), so
  llama.cpp reads the SiLU files we write. ``hidden_act`` picks the activation: ``silu``, ``relu``
  (ReluLLaMA: ReGLU), ``fatrelu`` with ``hidden_act_param`` (ProSparse); anything else is refused.
* ``bamboo``: PowerInfer's ``bamboo`` architecture, llama-shaped with dReLU (relu(gate) * relu(up)).
* ``opt``: PowerInfer's ``opt`` layout: LayerNorms with biases, biased projections, the learned
  position table whole (its first two rows are HF's offset, added at run time as PowerInfer does),
  fc1 as ``ffn_up`` and fc2 as ``ffn_down``, the head tied to the embeddings. Both key layouts
  (``model.decoder.*`` as transformers saves them, ``decoder.*`` as the original release). OPT-350m's
  post-LayerNorm and projected embeddings are refused.

A non-SiLU activation is written in our key (config.py's ACTIVATION_KEY) so no reader of ours can
take the file for a SiLU model. Every tensor of the checkpoint must be one we map, every tensor we
need must be there, and each must have the shape the config implies: a checkpoint whose config
disagrees with its tensors is an error naming the first tensor that disagrees.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from powerinfer.config import ACTIVATION_KEY, ACTIVATION_THRESHOLD_KEY
from powerinfer.convert.checkpoint import HFCheckpoint
from powerinfer.errors import ModelFileError, UnsupportedModelError, quoted

log = logging.getLogger(__name__)

FAMILIES = ("llama", "mistral", "bamboo", "opt")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # derived buffers some checkpoints carry


@dataclass(frozen=True)
class OutTensor:
    """One GGUF tensor: its name, its float32 data in numpy order (read when written), and whether
    it is a weight matrix the output type applies to (vectors stay F32)."""

    name: str
    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]
    matrix: bool


@dataclass
class Converted:
    """What a family makes of a checkpoint: GGUF architecture, metadata (key -> value; the writer
    picks the GGUF type from the Python type) and tensors in file order."""

    arch: str
    name: str
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[OutTensor] = field(default_factory=list)
    activation: str = "silu"
    n_layers: int = 0
    d_model: int = 0
    n_ff: int = 0


def _cfg_int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelFileError(f"config.json: {key} must be a positive integer, got {quoted(value)}")
    return value


def _cfg_float(cfg: dict[str, Any], key: str, default: float) -> float:
    value = cfg.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        raise ModelFileError(f"config.json: {key} must be a finite number, got {quoted(value)}")
    return float(value)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation: within each head, row 2j + k <- row k * D/2 + j (HF's halves -> pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _activation(cfg: dict[str, Any], model_type: str) -> tuple[str, float]:
    if model_type == "bamboo":
        return "drelu", 0.0
    act = cfg.get("hidden_act", "silu")
    if act in ("silu", "swish"):
        return "silu", 0.0
    if act == "relu":
        return "relu", 0.0
    if act == "fatrelu":
        t = _cfg_float(cfg, "hidden_act_param", 0.0)
        return ("fatrelu", t) if t else ("relu", 0.0)
    raise UnsupportedModelError(f"config.json: hidden_act {quoted(act)} is not supported for {model_type} "
                                f"(supported: silu, relu, fatrelu with hidden_act_param)")


def llama_family(ckpt: HFCheckpoint, model_type: str) -> Converted:
    cfg = ckpt.config
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise UnsupportedModelError(f"config.json: {flag} is set; llama-family files with biases are not supported")
    d, n_ff, n_layers = _cfg_int(cfg, "hidden_size"), _cfg_int(cfg, "intermediate_size"), _cfg_int(cfg, "num_hidden_layers")
    n_head = _cfg_int(cfg, "num_attention_heads")
    n_kv = _cfg_int(cfg, "num_key_value_heads", n_head)
    if n_head % n_kv:
        raise ModelFileError(f"config.json: {n_head} attention heads are not a multiple of {n_kv} key/value heads")
    head_dim = cfg.get("head_dim") or d // n_head
    head_dim = _cfg_int({"head_dim": head_dim}, "head_dim")
    vocab = _cfg_int(cfg, "vocab_size")
    activation, act_t = _activation(cfg, model_type)
    window = cfg.get("sliding_window")
    if isinstance(window, int) and 0 < window < _cfg_int(cfg, "max_position_embeddings", 2048):
        log.warning("config.json: sliding_window %d is not kept: like llama.cpp, the file attends to the whole context "
                    "(the same up to %d tokens)", window, window)
    arch = "bamboo" if model_type == "bamboo" else "llama"
    out = Converted(arch=arch, name=str(cfg.get("_name_or_path") or ckpt.folder.name), activation=activation,
                    n_layers=n_layers, d_model=d, n_ff=n_ff)
    m = out.metadata
    m[f"{arch}.context_length"] = _cfg_int(cfg, "max_position_embeddings", 2048)
    m[f"{arch}.embedding_length"] = d
    m[f"{arch}.block_count"] = n_layers
    m[f"{arch}.feed_forward_length"] = n_ff
    m[f"{arch}.attention.head_count"] = n_head
    m[f"{arch}.attention.head_count_kv"] = n_kv
    m[f"{arch}.rope.dimension_count"] = head_dim
    if head_dim != d // n_head:
        m[f"{arch}.attention.key_length"] = head_dim
        m[f"{arch}.attention.value_length"] = head_dim
    m[f"{arch}.attention.layer_norm_rms_epsilon"] = _cfg_float(cfg, "rms_norm_eps", 1e-6)
    m[f"{arch}.rope.freq_base"] = _cfg_float(cfg, "rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
    if kind not in (None, "default", "linear"):
        raise UnsupportedModelError(f"config.json: rope scaling {quoted(kind)} is not supported (linear only)")
    if kind == "linear":
        m[f"{arch}.rope.scaling.type"] = "linear"
        m[f"{arch}.rope.scaling.factor"] = _cfg_float(scaling, "factor", 1.0)
    if activation != "silu":
        m[ACTIVATION_KEY] = activation
        if act_t:
            m[ACTIVATION_THRESHOLD_KEY] = act_t

    want: dict[str, tuple[str, tuple[int, ...], Callable[[np.ndarray], np.ndarray] | None, bool]] = {
        "model.embed_tokens.weight": ("token_embd.weight", (vocab, d), None, True),
        "model.norm.weight": ("output_norm.weight", (d,), None, False),
    }
    tied = bool(cfg.get("tie_word_embeddings", False))
    if "lm_head.weight" in ckpt.tensors or not tied:
        want["lm_head.weight"] = ("output.weight", (vocab, d), None, True)
    for i in range(n_layers):
        hf, g = f"model.layers.{i}.", f"blk.{i}."
        want.update({
            hf + "input_layernorm.weight": (g + "attn_norm.weight", (d,), None, False),
            hf + "self_attn.q_proj.weight": (g + "attn_q.weight", (n_head * head_dim, d), lambda w: permute_qk(w, n_head), True),
            hf + "self_attn.k_proj.weight": (g + "attn_k.weight", (n_kv * head_dim, d), lambda w: permute_qk(w, n_kv), True),
            hf + "self_attn.v_proj.weight": (g + "attn_v.weight", (n_kv * head_dim, d), None, True),
            hf + "self_attn.o_proj.weight": (g + "attn_output.weight", (d, n_head * head_dim), None, True),
            hf + "post_attention_layernorm.weight": (g + "ffn_norm.weight", (d,), None, False),
            hf + "mlp.gate_proj.weight": (g + "ffn_gate.weight", (n_ff, d), None, True),
            hf + "mlp.up_proj.weight": (g + "ffn_up.weight", (n_ff, d), None, True),
            hf + "mlp.down_proj.weight": (g + "ffn_down.weight", (d, n_ff), None, True),
        })
    out.tensors = _map_tensors(ckpt, want)
    return out


def opt_family(ckpt: HFCheckpoint) -> Converted:
    cfg = ckpt.config
    d, n_ff, n_layers = _cfg_int(cfg, "hidden_size"), _cfg_int(cfg, "ffn_dim"), _cfg_int(cfg, "num_hidden_layers")
    n_head, vocab = _cfg_int(cfg, "num_attention_heads"), _cfg_int(cfg, "vocab_size")
    if d % n_head:
        raise ModelFileError(f"config.json: hidden_size {d} is not a multiple of {n_head} attention heads")
    if cfg.get("word_embed_proj_dim", d) != d:
        raise UnsupportedModelError("config.json: word_embed_proj_dim differs from hidden_size (OPT-350m's projected embeddings) "
                                    "is not supported")
    for flag, want in (("do_layer_norm_before", True), ("enable_bias", True), ("layer_norm_elementwise_affine", True),
                       ("_remove_final_layer_norm", False)):
        if cfg.get(flag, want) != want:
            raise UnsupportedModelError(f"config.json: {flag} = {quoted(cfg.get(flag))} is not supported (only {want}: pre-LayerNorm OPT)")
    act = cfg.get("activation_function", "relu")
    if act != "relu":
        raise UnsupportedModelError(f"config.json: activation_function {quoted(act)} is not supported for opt (relu)")
    n_pos = _cfg_int(cfg, "max_position_embeddings", 2048)
    out = Converted(arch="opt", name=str(cfg.get("_name_or_path") or ckpt.folder.name), activation="relu", n_layers=n_layers,
                    d_model=d, n_ff=n_ff)
    m = out.metadata
    m["opt.context_length"] = n_pos
    m["opt.embedding_length"] = d
    m["opt.block_count"] = n_layers
    m["opt.feed_forward_length"] = n_ff
    m["opt.attention.head_count"] = n_head
    m["opt.attention.head_count_kv"] = n_head
    m["opt.attention.layer_norm_epsilon"] = 1e-5  # torch.nn.LayerNorm's, which HF's OPT uses

    root = "model.decoder." if any(n.startswith("model.decoder.") for n in ckpt.tensors) else "decoder."
    Spec = tuple[str, tuple[int, ...], None, bool]

    def both(hf: str, gg: str, shape: tuple[int, ...]) -> dict[str, Spec]:
        """A biased projection or LayerNorm: its weight (a matrix when 2-D) and its bias."""
        return {hf + ".weight": (gg + ".weight", shape, None, len(shape) == 2), hf + ".bias": (gg + ".bias", (shape[0],), None, False)}

    want: dict[str, Spec] = {root + "embed_tokens.weight": ("token_embd.weight", (vocab, d), None, True),
                             root + "embed_positions.weight": ("position_embd.weight", (n_pos + 2, d), None, False)}
    want.update(both(root + "final_layer_norm", "output_norm", (d,)))
    if "lm_head.weight" in ckpt.tensors and not cfg.get("tie_word_embeddings", True):
        want["lm_head.weight"] = ("output.weight", (vocab, d), None, True)
    for i in range(n_layers):
        hf, g = f"{root}layers.{i}.", f"blk.{i}."
        want.update(both(hf + "self_attn_layer_norm", g + "attn_norm", (d,)))
        for proj, name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("out_proj", "attn_output")):
            want.update(both(hf + "self_attn." + proj, g + name, (d, d)))
        want.update(both(hf + "final_layer_norm", g + "ffn_norm", (d,)))
        want.update(both(hf + "fc1", g + "ffn_up", (n_ff, d)))
        want.update(both(hf + "fc2", g + "ffn_down", (d, n_ff)))
    # a tied head saved anyway (transformers writes lm_head.weight for some versions): the same values as the embeddings
    ignored = ("lm_head.weight",) if "lm_head.weight" not in want else ()
    out.tensors = _map_tensors(ckpt, want, ignored)
    return out


def _map_tensors(ckpt: HFCheckpoint,
                 want: dict[str, tuple[str, tuple[int, ...], Callable[[np.ndarray], np.ndarray] | None, bool]],
                 ignored: tuple[str, ...] = ()) -> list[OutTensor]:
    extra = [n for n in ckpt.tensors if n not in want and n not in ignored and not n.endswith(_IGNORED_SUFFIXES)]
    if extra:
        raise ModelFileError(f"{ckpt.folder}: tensor {quoted(extra[0])} is not part of this model as its config.json describes it"
                             + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    out = []
    for hf_name, (name, shape, fix, matrix) in want.items():
        src = ckpt.tensors.get(hf_name)
        if src is None:
            raise ModelFileError(f"{ckpt.folder}: tensor {quoted(hf_name)} is missing (a shard left out, or another model's weights)")
        if tuple(src.shape) != shape:
            raise ModelFileError(f"{ckpt.folder}: tensor {quoted(hf_name)} has shape {list(src.shape)}, but config.json implies "
                                 f"{list(shape)}")

        def read(src: Any = src, fix: Callable[[np.ndarray], np.ndarray] | None = fix) -> np.ndarray:
            data = np.ascontiguousarray(src.read(), dtype=np.float32)
            if not np.isfinite(data).all():
                raise ModelFileError(f"{ckpt.folder}: tensor {quoted(src.name)} holds NaN or infinite values")
            return np.ascontiguousarray(fix(data)) if fix is not None else data

        out.append(OutTensor(name, shape, read, matrix))
    return out


def convert_family(ckpt: HFCheckpoint) -> Converted:
    """The checkpoint's family, by config.json's model_type."""
    model_type = ckpt.config.get("model_type")
    if model_type in ("llama", "mistral", "bamboo"):
        return llama_family(ckpt, str(model_type))
    if model_type == "opt":
        return opt_family(ckpt)
    raise UnsupportedModelError(f"{ckpt.folder}: model_type {quoted(model_type)} is not supported (supported: {', '.join(FAMILIES)})")
