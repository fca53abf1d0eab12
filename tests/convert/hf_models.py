"""Seeded tiny Hugging Face checkpoints of each family and transformers as their oracle.

Runs in: pytest. ``make_checkpoint`` saves a random ``LlamaForCausalLM`` (ReLU, FATReLU, dReLU or
SiLU), or with act "opt" an ``OPTForCausalLM`` (LayerNorm, biases, learned positions, fc1/fc2 ReLU
MLP), with a small byte-level BPE tokenizer; ``oracle`` loads it back into transformers with the
activation the family defines written as a hook where transformers has none (ProSparse's FATReLU:
gate where gate > t; Bamboo's dReLU: relu(gate) * relu(up)), and returns its logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from powerinfer.api import LLM
from powerinfer.convert.run import convert

FATRELU_T = 0.02


def _corpus() -> str:
    """Varied English text that every Python has: the standard library's module docstrings."""
    import argparse, collections, csv, json, logging, pathlib, re, string, textwrap, typing  # noqa: E401

    return "\n\n".join(m.__doc__ or "" for m in (argparse, collections, csv, json, logging, pathlib, re, string, textwrap, typing))


TEXT = _corpus()
SPLIT = int(len(TEXT) * 0.8)  # training text before, held-out text after


def make_tokenizer(folder: Path, vocab: int = 300) -> int:
    """A byte-level BPE tokenizer (GPT-2 style, with <s> and </s>) saved in folder; returns its size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT[:SPLIT]], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"}))
    return tok.get_vocab_size()


def make_spm_tokenizer(folder: Path, vocab: int = 600) -> int:
    """A SentencePiece BPE tokenizer.model (byte fallback, <unk> <s> </s> = 0 1 2, as Llama 2's) in folder."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT[:SPLIT].splitlines()), model_writer=model, vocab_size=vocab,
                                   model_type="bpe", byte_fallback=True, character_coverage=0.995, unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, minloglevel=2, num_threads=1, remove_extra_whitespaces=False,
                                   normalization_rule_name="identity")
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                                              "add_bos_token": True, "tokenizer_class": "LlamaTokenizer"}))
    return vocab


def make_checkpoint(folder: Path, act: str = "relu", seed: int = 0, *, d: int = 64, n_ff: int = 128, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, tied: bool = False, train_steps: int = 0, spm: bool = False) -> Path:
    """Save a seeded random llama-family checkpoint: act is silu, relu, fatrelu (ProSparse) or drelu (Bamboo);
    opt: an OPT checkpoint (heads and kv_heads alike, its 2048 positions: PowerInfer's table size).

    train_steps > 0 first trains it that many steps on TEXT's training part (deterministic on one
    machine): a random model's next-token distributions are flat, so 8-bit rounding flips near
    ties that a trained model does not have; quantization is judged on a trained one."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = make_spm_tokenizer(folder) if spm else make_tokenizer(folder)
    torch.manual_seed(seed)
    model: LlamaForCausalLM | OPTForCausalLM
    if act == "opt":
        model = OPTForCausalLM(OPTConfig(vocab_size=vocab, hidden_size=d, ffn_dim=n_ff, num_hidden_layers=layers,
                                         num_attention_heads=heads, max_position_embeddings=2048, word_embed_proj_dim=d,
                                         bos_token_id=0, eos_token_id=1, pad_token_id=1, dropout=0.0))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=n_ff, num_hidden_layers=layers,
                                             num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                                             hidden_act="silu" if act == "silu" else "relu", rms_norm_eps=1e-5, tie_word_embeddings=tied,
                                             bos_token_id=1 if spm else 0, eos_token_id=2 if spm else 1))
    with torch.no_grad():  # larger weights than HF's 0.02 init: activations that are far from zero and from linear
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed_positions" not in name:
                p.normal_(0.0, 1.0 / np.sqrt(p.shape[1]))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.ndim == 1 or "embed_positions" in name:  # biases, LayerNorm biases, positions: small, not zero
                p.normal_(0.0, 0.1)
    if train_steps:
        _train(model, folder, act, train_steps, seed)
    model.save_pretrained(folder, safe_serialization=True)
    config = json.loads((folder / "config.json").read_text())
    if act == "fatrelu":
        config.update(hidden_act="fatrelu", hidden_act_param=FATRELU_T)
    elif act == "drelu":
        config.update(model_type="bamboo", architectures=["BambooForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def tokens(folder: Path, text: str) -> list[int]:
    if (folder / "tokenizer.json").exists():
        return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model")).encode(text)


def _train(model: LlamaForCausalLM | OPTForCausalLM, folder: Path, act: str, steps: int, seed: int) -> None:
    if act != "opt":
        _hook(model, act, FATRELU_T)
    data = torch.tensor(tokens(folder, TEXT[:SPLIT]))
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 65, (8,), generator=g)
        x = torch.stack([data[s : s + 65] for s in starts])
        logits = model(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


class _FATReLU(torch.nn.Module):
    def __init__(self, t: float) -> None:
        super().__init__()
        self.t = t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.threshold(x, self.t, 0.0)


def load_oracle(folder: Path) -> LlamaForCausalLM | OPTForCausalLM:
    """The checkpoint in transformers, with the family's activation hooked in."""
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") == "opt":
        return OPTForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    act = "drelu" if config.get("model_type") == "bamboo" else config.get("hidden_act")
    cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures", "hidden_act_param")})
    if act in ("fatrelu", "drelu"):
        cfg.hidden_act = "relu"
    model = LlamaForCausalLM.from_pretrained(folder, config=cfg, dtype=torch.float32)
    _hook(model, act, float(config.get("hidden_act_param", 0.0)))
    return model.eval()


def _hook(model: LlamaForCausalLM, act: str, t: float) -> None:
    """The family's activation where transformers' LlamaMLP has none: FATReLU, or dReLU's relu(gate) * relu(up)."""
    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.fat_t, mlp.drelu = (t if act == "fatrelu" else 0.0), act == "drelu"  # for hook_powerinfer_rule
        if act == "fatrelu":
            mlp.act_fn = _FATReLU(t)
        elif act == "drelu":
            mlp.forward = (lambda m: lambda x: m.down_proj(torch.relu(m.gate_proj(x)) * torch.relu(m.up_proj(x))))(mlp)


def oracle_logits(model: LlamaForCausalLM | OPTForCausalLM, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def q8_0_agreement(folder: Path, act: str, seed: int) -> tuple[int, int, int, int]:
    """Top-1 agreement of the Q8_0 conversion of a checkpoint trained 120 steps, on TEXT's held-out
    part in windows of 64: (ours vs transformers, transformers with exactly the file's Q8_0 weights vs
    transformers, ours vs that, positions). The second isolates what the weights' rounding costs."""
    src = make_checkpoint(folder / "hf", act, seed=seed, train_steps=120)
    path = convert(src, folder / "q8_0.gguf", "q8_0")[0]
    oracle, rounded = load_oracle(src), load_oracle(src)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if p.ndim == 2 and "embed_positions" not in name:  # OPT's position table stays F32 in the file
                w = dequantize(quantize(p.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(w.reshape(p.shape)))
    held = tokens(src, TEXT[SPLIT:])
    vs_float = rounded_vs_float = vs_rounded = total = 0
    llm = LLM(path, n_ctx=128, executor="inprocess")
    try:
        for k in range(len(held) // 64):
            ids = held[k * 64 : (k + 1) * 64]
            ref, q8, ours = (oracle_logits(oracle, ids).argmax(-1), oracle_logits(rounded, ids).argmax(-1),
                             llm.logits(ids).argmax(-1))
            vs_float += int((ours == ref).sum())
            rounded_vs_float += int((q8 == ref).sum())
            vs_rounded += int((ours == q8).sum())
            total += len(ids)
    finally:
        llm.close()
    return vs_float, rounded_vs_float, vs_rounded, total


def write_predictor_dir(folder: Path, checkpoint: Path, rank: int = 16, seed: int = 0, threshold: float | None = None) -> Path:
    """A PowerInfer predictor folder for the checkpoint: model_N.pt with fc1 [rank, d], fc2 [n_ff, rank]
    (seeded random; about half the neurons predicted on), and config.json with sparse_threshold."""
    config = json.loads((checkpoint / "config.json").read_text())
    d, n_ff, layers = config["hidden_size"], config.get("intermediate_size") or config["ffn_dim"], config["num_hidden_layers"]
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for i in range(layers):
        torch.save({"fc1.weight": torch.randn(rank, d, generator=g) / d**0.5,
                    "fc2.weight": torch.randn(n_ff, rank, generator=g) / rank**0.5}, folder / f"model_{i}.pt")
    if threshold is not None:
        (folder / "config.json").write_text(json.dumps({"sparse_threshold": threshold}))
    return folder


def hook_powerinfer_rule(model: LlamaForCausalLM | OPTForCausalLM, predictors: Path,
                         threshold: float = 0.0) -> LlamaForCausalLM | OPTForCausalLM:
    """PowerInfer's sparse rule in transformers: neuron j of a layer runs iff fc2(relu(fc1(x)))_j >=
    threshold, x the residual stream entering the FFN's norm (what PowerInfer's predictor reads)."""
    if isinstance(model, OPTForCausalLM):
        return _hook_opt_rule(model, predictors, threshold)
    for i, layer in enumerate(model.model.layers):
        state = torch.load(predictors / f"model_{i}.pt", weights_only=True)
        fc1, fc2 = state["fc1.weight"], state["fc2.weight"]
        seen: dict[str, torch.Tensor] = {}
        layer.post_attention_layernorm.register_forward_pre_hook(lambda mod, args, seen=seen: seen.__setitem__("x", args[0]))
        mlp, inner = layer.mlp, layer.mlp.forward

        def forward(h: torch.Tensor, mlp: torch.nn.Module = mlp, seen: dict[str, torch.Tensor] = seen,
                    fc1: torch.Tensor = fc1, fc2: torch.Tensor = fc2) -> torch.Tensor:
            on = (torch.relu(seen["x"] @ fc1.T) @ fc2.T) >= threshold  # [B, T, n_ff]
            up = mlp.up_proj(h)
            gate = mlp.gate_proj(h)
            a = torch.relu(up) if getattr(mlp, "drelu", False) else up
            act = torch.nn.functional.threshold(gate, getattr(mlp, "fat_t", 0.0), 0.0)
            return mlp.down_proj(act * a * on)

        mlp.forward = forward
        del inner
    return model


def _hook_opt_rule(model: OPTForCausalLM, predictors: Path, threshold: float) -> OPTForCausalLM:
    """The same rule on OPT: x is the residual entering final_layer_norm (a LayerNorm, which is why our
    predictors on the normed input cannot express it); fc2's input relu(fc1 h + b1) [N, n_ff] is masked."""
    for i, layer in enumerate(model.model.decoder.layers):
        state = torch.load(predictors / f"model_{i}.pt", weights_only=True)
        seen: dict[str, torch.Tensor] = {}
        layer.final_layer_norm.register_forward_pre_hook(lambda mod, args, seen=seen: seen.__setitem__("x", args[0]))

        def mask(mod: torch.nn.Module, args: tuple[torch.Tensor, ...], seen: dict[str, torch.Tensor] = seen,
                 fc1: torch.Tensor = state["fc1.weight"], fc2: torch.Tensor = state["fc2.weight"]) -> tuple[torch.Tensor]:
            on = (torch.relu(seen["x"] @ fc1.T) @ fc2.T) >= threshold  # [N, n_ff], the residual's rows as fc2's input's
            return (args[0] * on.reshape(args[0].shape),)

        layer.fc2.register_forward_pre_hook(mask)
    return model
