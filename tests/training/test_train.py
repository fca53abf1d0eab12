"""The training model against transformers, and the small recipe end to end: trained, converted,
and run by the engine with the same numbers as the training model.

Runs in: pytest. The recipe test needs Debian's python3.11-doc (.ci/run installs it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from powerinfer.api import LLM
from powerinfer.training.corpus import DEFAULT_CORPUS
from powerinfer.training.model import TinyLlama, TinyLlamaConfig
from powerinfer.training.train import train, zero_share
from tests.convert.hf_models import _hook


@pytest.mark.parametrize("act", ["silu", "relu", "fatrelu", "drelu"])
def test_the_training_model_is_transformers_llama(act: str) -> None:
    torch.manual_seed(0)
    cfg = TinyLlamaConfig(vocab=97, d=64, layers=2, heads=4, kv_heads=2, n_ff=96, activation=act, act_threshold=0.01)
    ours = TinyLlama(cfg).eval()
    with torch.no_grad():
        for p in ours.parameters():  # away from the tiny init, so every part matters
            p.add_(0.05 * torch.randn_like(p))
    hf_cfg = {k: v for k, v in cfg.hf_config().items() if k not in ("model_type", "architectures", "hidden_act_param", "torch_dtype")}
    hf_cfg["hidden_act"] = "silu" if act == "silu" else "relu"
    hf = LlamaForCausalLM(LlamaConfig(**hf_cfg)).eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)
    hf.tie_weights()
    _hook(hf, act, cfg.act_threshold)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ours(ids), hf(ids).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), float((a - b).abs().max())


@pytest.mark.skipif(not DEFAULT_CORPUS.is_dir(), reason="Debian's python3.11-doc is not installed")
def test_the_ci_recipe_trains_a_sparse_model_the_engine_runs(tmp_path: Path) -> None:
    gguf = train(tmp_path / "run", "relu", "ci", threads=2)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["train_tokens"] > 50_000 and summary["seconds"] < 180
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "train.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0] - 1.0  # it learned
    held = (tmp_path / "run" / "heldout.txt").read_text()
    llm = LLM(gguf, n_ctx=256, executor="inprocess")
    try:
        ids = llm.tokenize(held[:2000], add_bos=True)[:128]
        ours = llm.logits(ids)
    finally:
        llm.close()
    model = TinyLlama(TinyLlamaConfig(**summary["model"])).eval()
    model.load_state_dict(torch.load(tmp_path / "run" / "pytorch_model.bin", weights_only=True))
    with torch.no_grad():
        ref = model(torch.tensor([ids]))[0].double().numpy()
    assert np.abs(ours - ref).max() / (ref.max() - ref.min()) < 1e-4
    zeros = zero_share(gguf, held, 256)
    assert len(zeros) == 2 and (zeros > 0.3).all()  # ReLU: a large share of exact zeros already
