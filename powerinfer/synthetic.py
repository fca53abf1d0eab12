"""Synthetic GGUF models: small random llama/qwen2/gemma3 files with a byte-level tokenizer.

Runs in: tests and tools (CLI process). They exercise every code path on shapes we choose,
without downloads; the real models cover correctness against llama.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from powerinfer.config import ACTIVATION_KEY, ACTIVATION_THRESHOLD_KEY
from powerinfer.errors import InvalidArgumentError


@dataclass(frozen=True)
class SyntheticSpec:
    arch: str = "llama"  # llama | qwen2 | gemma3
    n_layers: int = 2
    d_model: int = 64
    n_ff: int = 160
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    context_length: int = 256
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32  # type of the 2-D weight matrices
    seed: int = 0
    activation: str | None = None  # written as powerinfer.ffn_activation (None: the architecture's own)
    act_threshold: float = 0.0  # FATReLU's threshold, with activation "fatrelu"


def byte_vocab() -> tuple[list[str], list[int]]:
    """GPT-2 byte-level vocabulary: 256 byte tokens + <s>, </s> (control)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    tokens = [chr(table[b]) for b in range(256)] + ["<s>", "</s>"]
    types = [1] * 256 + [3, 3]
    return tokens, types


def write_synthetic_gguf(path: str | Path, spec: SyntheticSpec = SyntheticSpec()) -> Path:
    """Write a random model; returns the path. Weights are N(0, 1/sqrt(fan_in)) so activations stay sane."""
    if spec.arch not in ("llama", "qwen2", "gemma3"):
        raise InvalidArgumentError(f"unknown synthetic architecture {spec.arch!r}")
    rng = np.random.default_rng(spec.seed)
    path = Path(path)
    tokens, types = byte_vocab()
    vocab = len(tokens)
    a = spec.arch
    w = GGUFWriter(str(path), a)
    w.add_name(f"synthetic-{a}")
    w.add_block_count(spec.n_layers)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.d_model)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if spec.activation is not None:
        w.add_string(ACTIVATION_KEY, spec.activation)
        if spec.act_threshold:
            w.add_float32(ACTIVATION_THRESHOLD_KEY, spec.act_threshold)
    if a == "gemma3":
        w.add_sliding_window(8)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_add_bos_token(True)

    def mat(name: str, rows: int, cols: int, qtype: GGMLQuantizationType = spec.qtype) -> None:
        data = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)

    def vec(name: str, n: int, mean: float = 1.0) -> None:
        w.add_tensor(name, (mean + 0.1 * rng.standard_normal(n)).astype(np.float32))

    d, f, hd = spec.d_model, spec.n_ff, spec.head_dim
    mat("token_embd.weight", vocab, d, GGMLQuantizationType.Q8_0 if spec.qtype != GGMLQuantizationType.F32 else spec.qtype)
    vec("output_norm.weight", d)
    if a == "qwen2":
        mat("output.weight", vocab, d)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", d)
        vec(p + "ffn_norm.weight", d)
        mat(p + "attn_q.weight", spec.n_heads * hd, d)
        mat(p + "attn_k.weight", spec.n_kv_heads * hd, d)
        mat(p + "attn_v.weight", spec.n_kv_heads * hd, d)
        mat(p + "attn_output.weight", d, spec.n_heads * hd)
        mat(p + "ffn_gate.weight", f, d)
        mat(p + "ffn_up.weight", f, d)
        mat(p + "ffn_down.weight", d, f)
        if a == "qwen2":
            for part, n in (("attn_q", spec.n_heads * hd), ("attn_k", spec.n_kv_heads * hd), ("attn_v", spec.n_kv_heads * hd)):
                vec(p + part + ".bias", n, 0.0)
        if a == "gemma3":
            vec(p + "attn_q_norm.weight", hd)
            vec(p + "attn_k_norm.weight", hd)
            vec(p + "post_attention_norm.weight", d)
            vec(p + "post_ffw_norm.weight", d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
