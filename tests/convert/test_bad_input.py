"""Bad input to ``powerinfer convert`` and to PowerInfer-file loading: one clear error, nothing run,
nothing half-written."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from powerinfer.api import LLM
from powerinfer.convert.checkpoint import HFCheckpoint
from powerinfer.convert.families import convert_family
from powerinfer.convert.predictors import ResidualPredictors
from powerinfer.convert.run import convert
from powerinfer.convert.writer import write_model
from powerinfer.convert.vocab import tokenizer_metadata
from powerinfer.errors import ModelFileError, PowerInferError, UnsupportedModelError
from powerinfer.synthetic import SyntheticSpec, write_synthetic_gguf
from tests.convert.hf_models import make_checkpoint, write_predictor_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("hf") / "relu", "relu", seed=2)


def _copy(hf: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(hf, dst)
    return dst


def _edit_config(folder: Path, **changes: object) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_config_that_disagrees_with_its_tensors(hf: Path, tmp_path: Path) -> None:
    folder = _copy(hf, tmp_path)
    _edit_config(folder, intermediate_size=96)
    with pytest.raises(ModelFileError, match=r"mlp\.gate_proj\.weight.*shape \[128, 64\].*\[96, 64\]"):
        convert(folder, tmp_path / "x.gguf", "f32")
    assert not (tmp_path / "x.gguf").exists()


def test_unknown_activation_and_family(hf: Path, tmp_path: Path) -> None:
    folder = _copy(hf, tmp_path)
    _edit_config(folder, hidden_act="gelu_new")
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu_new' is not supported"):
        convert(folder, tmp_path / "x.gguf")
    _edit_config(folder, hidden_act="relu", model_type="gpt_neox")
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt_neox' is not supported"):
        convert(folder, tmp_path / "x.gguf")


def test_unknown_activation_in_a_gguf_file(tmp_path: Path) -> None:
    path = write_synthetic_gguf(tmp_path / "m.gguf", SyntheticSpec(activation="swiglu2"))
    with pytest.raises(UnsupportedModelError, match="FFN activation 'swiglu2'.*not supported"):
        LLM(path, executor="inprocess")
    bad = write_synthetic_gguf(tmp_path / "t.gguf", SyntheticSpec(activation="relu", act_threshold=0.5))
    with pytest.raises(ModelFileError, match="only fatrelu has a threshold"):
        LLM(bad, executor="inprocess")


def test_missing_shard(hf: Path, tmp_path: Path) -> None:
    folder = _copy(hf, tmp_path)
    names = list(HFCheckpoint(folder).tensors)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {n: ("model-00001-of-00002.safetensors" if i % 2 else "model-00002-of-00002.safetensors") for i, n in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelFileError, match="names 1 shard.*missing: model-00002-of-00002.safetensors"):
        convert(folder, tmp_path / "x.gguf")


class _Evil:
    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple[object, tuple[str, ...]]:
        return (os.system, (f"touch {self.canary}",))


def test_a_pickle_that_runs_code_is_refused_unrun(hf: Path, tmp_path: Path) -> None:
    folder = tmp_path / "evil"
    folder.mkdir()
    shutil.copy(hf / "config.json", folder)
    canary = tmp_path / "ran"
    with open(folder / "pytorch_model.bin", "wb") as fh:
        pickle.dump({"model.norm.weight": _Evil(canary)}, fh)
    with pytest.raises(ModelFileError, match="refused"):
        convert(folder, tmp_path / "x.gguf")
    assert not canary.exists()
    preds = tmp_path / "pred"
    preds.mkdir()
    torch.save({"fc1.weight": torch.zeros(4, 64), "fc2.weight": torch.zeros(128, 4)}, preds / "model_0.pt")
    with open(preds / "model_1.pt", "wb") as fh:
        pickle.dump(_Evil(canary), fh)
    with pytest.raises(ModelFileError, match="model_1.pt: refused"):
        convert(hf, tmp_path / "y.gguf", "f32", predictor=preds)
    assert not canary.exists()


def test_hostile_safetensors_header(hf: Path, tmp_path: Path) -> None:
    folder = _copy(hf, tmp_path)
    (folder / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(ModelFileError, match="not a safetensors file"):
        convert(folder, tmp_path / "x.gguf")


def test_predictor_that_does_not_fit(hf: Path, tmp_path: Path) -> None:
    preds = tmp_path / "pred"
    preds.mkdir()
    for i in range(2):
        torch.save({"fc1.weight": torch.zeros(8, 32), "fc2.weight": torch.zeros(128, 8)}, preds / f"model_{i}.pt")
    with pytest.raises(ModelFileError, match=r"model_0.pt: fc1 \[8, 32\].*width 64"):
        convert(hf, tmp_path / "x.gguf", "f32", predictor=preds)
    (preds / "model_1.pt").unlink()
    with pytest.raises(ModelFileError, match="no model_1.pt"):
        convert(hf, tmp_path / "x.gguf", "f32", predictor=preds)


def test_pwri_file_missing_a_layers_predictor(hf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POWERINFER_CACHE", str(tmp_path / "cache"))
    ckpt = HFCheckpoint(hf)
    model = convert_family(ckpt)
    only_first = ResidualPredictors((np.zeros((8, 64), np.float32),), (np.zeros((128, 8), np.float32),), 0.0)
    path = write_model(tmp_path / "m.powerinfer.gguf", model, tokenizer_metadata(ckpt, 300), "f16", only_first, powerinfer=True)
    with pytest.raises(ModelFileError, match="without blk.1.fc1.weight"):
        LLM(path, executor="inprocess")
    proc = _cli("-m", str(path), "-p", "hi", "-n", "2", env={"POWERINFER_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and "blk.1.fc1.weight" in proc.stderr
    assert not (tmp_path / "cache" / "pwri").exists() or not any((tmp_path / "cache" / "pwri").iterdir())


@pytest.mark.slow
def test_cli_convert_and_run(hf: Path, tmp_path: Path) -> None:
    preds = write_predictor_dir(tmp_path / "pred", hf, seed=1)
    out = tmp_path / "m.powerinfer.gguf"
    proc = _cli("convert", str(hf), "-o", str(out), "--outtype", "f16", "--predictor", str(preds), "--powerinfer")
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}" in proc.stdout
    env = {"POWERINFER_CACHE": str(tmp_path / "cache")}
    for extra in ((), ("--no-sparse",)):
        run = _cli("-m", str(out), "-p", "The quick", "-n", "4", "--temp", "0", "-t", "1", *extra, env=env)
        assert run.returncode == 0, run.stderr
        assert run.stdout.startswith("The quick")
    bad = _cli("convert", str(tmp_path / "nowhere"), "-o", str(tmp_path / "z.gguf"))
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1].startswith("error: ") and "no such file or folder" in bad.stderr
    usage = _cli("convert", str(hf))
    assert usage.returncode == 2 and "--outfile" in usage.stderr


def test_every_error_is_ours(hf: Path, tmp_path: Path) -> None:
    """Nothing above escapes as a raw exception: the classes are PowerInferError's."""
    assert issubclass(ModelFileError, PowerInferError) and issubclass(UnsupportedModelError, PowerInferError)
