"""``powerinfer train-relu``: a llama-shaped ReLU-family model trained from scratch, deterministically.

Runs in: the CLI process.

    powerinfer train-relu -o runs/relu --act relu --size full     # the model the sparse benchmarks use
    powerinfer train-relu -o runs/silu --act silu --size full     # its SiLU twin (same recipe)
    powerinfer train-relu -o runs/ci --size ci                    # the small one the tests make (< 1 minute)

The recipe (one per ``--size``) fixes everything: a byte-level BPE tokenizer trained on the
training text, the model's shape, the steps, batch, sequence length, AdamW with warmup and cosine
decay, bf16 autocast where the CPU has bf16 (else float32), seeds, and the thread count, so the
same corpus and torch give the same weights. The output folder is a Hugging Face checkpoint
(config.json, pytorch_model.bin, tokenizer.json, tokenizer_config.json), the held-out text
(heldout.txt), its end again (calibration.txt, for ``powerinfer calibrate``: calibration_text), the
training log (train.jsonl), summary.json and ``model.gguf`` (F32, by ``powerinfer convert``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from powerinfer.training.corpus import DEFAULT_CORPUS, read_corpus
from powerinfer.training.model import TinyLlama, TinyLlamaConfig

log = logging.getLogger(__name__)

ACTIVATIONS = ("relu", "drelu", "fatrelu", "silu")
CALIBRATION_CHARS = 120_000  # the end of the held-out text, written as calibration.txt (see calibration_text)


def calibration_text(held_out: str) -> str:
    """The text `powerinfer calibrate` is given: the end of the held-out documents (at most half of them),
    disjoint from their start, which the figures score. Not the training text: thresholds set on text
    the model has memorised cost about twice as much perplexity on new text (docs/sparsity.md)."""
    return held_out[-min(CALIBRATION_CHARS, len(held_out) // 2):]


@dataclass(frozen=True)
class Recipe:
    shape: TinyLlamaConfig  # the model (its activation is the run's --act)
    seq: int
    batch: int
    steps: int
    lr: float
    warmup: int
    max_files: int = 0  # 0: the whole corpus


RECIPES = {
    # ~1 minute on 2 cores: what the tests make for themselves
    "ci": Recipe(TinyLlamaConfig(vocab=1024, d=64, layers=2, heads=4, kv_heads=2, n_ff=256), seq=128, batch=8, steps=200, lr=3e-3,
                 warmup=20, max_files=60),
    # ~14 minutes on 2 cores with bf16 (0.69 s a step), 3M parameters, 4.9M tokens
    "small": Recipe(TinyLlamaConfig(vocab=4096, d=192, layers=4, heads=6, kv_heads=2, n_ff=768), seq=256, batch=16, steps=1200,
                    lr=2e-3, warmup=100),
    # ~80 minutes on 2 cores with bf16 (2.3 s a step on AVX-512 BF16; ~1 s with AMX), 16M parameters, 8.2M tokens
    "full": Recipe(TinyLlamaConfig(vocab=8192, d=384, layers=6, heads=6, kv_heads=2, n_ff=1536), seq=256, batch=16, steps=2000,
                   lr=1.5e-3, warmup=200),
}


def train_tokenizer(text: str, vocab: int, folder: Path) -> list[int]:
    """A byte-level BPE (GPT-2's pre-tokenizer, <s> and </s> at ids 0 and 1) saved in folder; returns text's ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([text], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    return tok.encode(text).ids


def _lr(step: int, r: Recipe) -> float:
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    p = (step - r.warmup) / max(1, r.steps - r.warmup)
    return r.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def train(out: Path, act: str = "relu", size: str = "full", corpus: Path = DEFAULT_CORPUS, seed: int = 0, threads: int = 2,
          act_threshold: float = 0.0) -> Path:
    """Train and save; returns the GGUF file's path."""
    from powerinfer.convert.run import convert

    r = RECIPES[size]
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    text = read_corpus(corpus, r.max_files)
    (out / "heldout.txt").write_text(text.held_out, encoding="utf-8")
    (out / "calibration.txt").write_text(calibration_text(text.held_out), encoding="utf-8")  # unseen in training, for calibrate
    ids = torch.tensor(train_tokenizer(text.train, r.shape.vocab, out), dtype=torch.long)
    cfg = replace(r.shape, activation=act, act_threshold=act_threshold, context=max(512, r.seq))
    model = TinyLlama(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=r.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    bf16 = torch.backends.mkldnn.is_available() and _has_bf16()
    logf = open(out / "train.jsonl", "w")
    model.train()
    for step in range(r.steps):
        for g in opt.param_groups:
            g["lr"] = _lr(step, r)
        starts = torch.randint(0, len(ids) - r.seq - 1, (r.batch,), generator=gen)
        x = torch.stack([ids[s : s + r.seq + 1] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, cfg.vocab), x[:, 1:].reshape(-1))
        value = float(loss.detach())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == r.steps - 1:
            rec = {"step": step, "loss": round(value, 4), "lr": _lr(step, r), "s": round(time.perf_counter() - t0, 1)}
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
            log.info("step %d/%d loss %.3f (%.0f s)", step, r.steps, value, time.perf_counter() - t0)
    logf.close()
    model.eval()
    (out / "config.json").write_text(json.dumps(cfg.hf_config(), indent=1))
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "pytorch_model.bin")
    gguf = convert(out, out / "model.gguf", "f32")[0]
    summary = {"activation": act, "size": size, "recipe": asdict(r), "model": asdict(cfg), "seed": seed, "threads": threads, "bf16": bf16,
               "corpus": str(corpus), "corpus_files": text.files, "corpus_sha256": text.sha256, "train_tokens": len(ids),
               "held_out_chars": len(text.held_out), "seconds": round(time.perf_counter() - t0, 1), "torch": torch.__version__,
               "params": sum(p.numel() for p in model.parameters())}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return gguf


def _has_bf16() -> bool:
    """bf16 autocast pays only where the CPU computes bf16 natively (AVX-512 BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def zero_share(path: Path, text: str, n_tokens: int = 512) -> np.ndarray:
    """Per layer, the share of FFN neurons whose hidden value is exactly 0, over the text's first tokens
    (the model's own GGUF through the numpy reference)."""
    from powerinfer.config import config_from_gguf
    from powerinfer.gguf_file import GGUFFile
    from powerinfer.model import reference
    from powerinfer.tokenizer import GGUFTokenizer

    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    ids = np.asarray(GGUFTokenizer.from_metadata(f.metadata).encode(text, add_bos=True)[:n_tokens])[None]
    out = []
    for lo in reference.layers(f, cfg, ids, dtype=np.float32):
        h = reference.glu(lo.gate, lo.up, cfg.activation, cfg.act_threshold)
        out.append(float((h == 0).mean()))
    return np.array(out)

