"""``powerinfer convert``: a Hugging Face folder (or one of our GGUF files) into GGUF or PWRI.

Runs in: the CLI process.

    powerinfer convert HF_DIR -o model.gguf [--outtype f32|f16|q8_0|q4_0]
    powerinfer convert HF_DIR -o model.powerinfer.gguf --outtype f16 --predictor PRED_DIR --powerinfer
    powerinfer convert ours.gguf -o ours.powerinfer.gguf --outtype q4_0 --predictor PRED_DIR --powerinfer

``--predictor`` takes PowerInfer's predictor folder (model_N.pt files) or one of our .predictor
files. Without ``--powerinfer`` a predictor is written beside the output as ``OUT.predictor`` (ours);
with it, into the PWRI file as PowerInfer's fc1/fc2.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from powerinfer.config import ACTIVATION_THRESHOLD_KEY, config_from_gguf
from powerinfer.convert.checkpoint import HFCheckpoint
from powerinfer.convert.families import Converted, OutTensor, convert_family
from powerinfer.convert.predictors import ResidualPredictors, ours_as_residual, read_powerinfer_dir
from powerinfer.convert.vocab import tokenizer_metadata
from powerinfer.convert.writer import write_model
from powerinfer.errors import InvalidArgumentError, ModelFileError, UnsupportedModelError
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.reference import weight
from powerinfer.predictors.powerinfer_formats import powerinfer_predictor
from powerinfer.predictors.predictor_file import PredictorFile, read_predictor, write_predictor

log = logging.getLogger(__name__)

# GGUF metadata a re-written file must not copy (the writer sets them, or they describe the old layout)
_NOT_COPIED = ("general.architecture", "general.name", "general.file_type", "general.alignment", "GGUF.")


def from_gguf(f: GGUFFile) -> tuple[Converted, dict[str, object]]:
    """One of our GGUF files as a Converted model (tensors decoded to float32 when written) and its other metadata."""
    cfg = config_from_gguf(f)
    if cfg.arch not in ("llama", "bamboo", "opt"):
        raise UnsupportedModelError(f"{f.path}: converting a {cfg.arch} file is not supported (llama, bamboo and opt files)")
    out = Converted(arch=cfg.arch, name=cfg.name, activation=cfg.activation, n_layers=cfg.n_layers, d_model=cfg.d_model,
                    n_ff=cfg.n_ff)
    meta: dict[str, object] = {}
    for key, value in f.metadata.items():
        if key.startswith(_NOT_COPIED):
            continue
        if isinstance(value, np.ndarray):
            value = value.tolist()
        elif isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, list) and value and isinstance(value[0], bytes):
            value = [v.decode("utf-8", "surrogateescape") for v in value]
        meta[key] = value
    for name, info in f.tensors.items():
        out.tensors.append(OutTensor(name, tuple(info.shape), lambda name=name: np.asarray(weight(f, name, np.float32)),
                                     matrix=len(info.shape) == 2 and name != "position_embd.weight"))  # F32, as from HF
    return out, meta


def _norms(model: Converted) -> list[np.ndarray] | None:
    """Each layer's ffn_norm weights, to move a predictor between the residual stream and the normed
    input (exact for RMSNorm); None for a LayerNorm (OPT), whose mean subtraction does not move: a
    predictor there stays one of the residual stream (PredictorFile.input "residual")."""
    by_name = {t.name: t for t in model.tensors}
    if "blk.0.ffn_norm.bias" in by_name:
        return None
    return [by_name[f"blk.{i}.ffn_norm.weight"].read().astype(np.float32) for i in range(model.n_layers)]


def _read_predictor(path: Path, model: Converted) -> tuple[ResidualPredictors | None, PredictorFile | None]:
    """(PowerInfer's form, our form) of the predictor at path; one of them is None when not needed yet."""
    if path.is_dir():
        return read_powerinfer_dir(path, model.n_layers, model.d_model, model.n_ff), None
    pf = read_predictor(path)
    if (pf.n_layers, pf.d_model, pf.n_ff) != (model.n_layers, model.d_model, model.n_ff):
        raise ModelFileError(f"{path}: a predictor for {pf.n_layers} layers, width {pf.d_model}, {pf.n_ff} neurons; the model has "
                             f"{model.n_layers}, {model.d_model}, {model.n_ff}")
    return None, pf


def convert(src: str | Path, out: str | Path, outtype: str = "f16", predictor: str | Path | None = None,
            powerinfer: bool = False) -> list[Path]:
    """Convert src to out; returns the files written (the model, and OUT.predictor when one was made)."""
    src, out = Path(src), Path(out)
    if powerinfer and predictor is None:
        raise InvalidArgumentError("--powerinfer needs --predictor (PowerInfer's files carry one per layer)")
    if src.is_dir():
        ckpt = HFCheckpoint(src)
        model = convert_family(ckpt)
        vocab_rows = next(t.shape[0] for t in model.tensors if t.name == "token_embd.weight")
        meta: dict[str, object] = dict(tokenizer_metadata(ckpt, vocab_rows))
    elif src.is_file():
        model, meta = from_gguf(GGUFFile(src))
    else:
        raise ModelFileError(f"{src}: no such file or folder")
    if powerinfer:
        _check_powerinfer_activation(model, meta)
    residual, ours = _read_predictor(Path(predictor), model) if predictor is not None else (None, None)
    written: list[Path] = []
    if powerinfer:
        if residual is None:
            assert ours is not None
            residual = ours_as_residual(ours, _norms(model), str(predictor))
        written.append(write_model(out, model, meta, outtype, residual, powerinfer=True))
        return written
    written.append(write_model(out, model, meta, outtype))
    if predictor is not None:
        if ours is None:
            assert residual is not None
            fcs = [(fc1, fc2, None, None) for fc1, fc2 in zip(residual.fc1, residual.fc2)]
            ours = powerinfer_predictor(model.name, fcs, residual.threshold, _norms(model), str(predictor))
        pred_path = out.with_name(out.name + ".predictor") if out.suffix != ".gguf" else out.with_suffix(".predictor")
        write_predictor(pred_path, ours)
        written.append(pred_path)
    return written


def _check_powerinfer_activation(model: Converted, meta: dict[str, object]) -> None:
    """PowerInfer hard-codes the activation per architecture: llama is ReLU, bamboo dReLU."""
    if model.activation == "drelu" and model.arch != "bamboo":
        model.arch = "bamboo"  # the same tensors; PowerInfer knows dReLU only by this architecture
        for key in [k for k in model.metadata if k.startswith("llama.")]:
            model.metadata["bamboo." + key[len("llama."):]] = model.metadata.pop(key)
        for key in [k for k in meta if k.startswith("llama.")]:
            meta["bamboo." + key[len("llama."):]] = meta.pop(key)
    if model.activation in ("silu", "gelu_tanh"):
        raise UnsupportedModelError(f"PowerInfer runs {model.arch} files as ReLU models; this one is {model.activation} "
                                    f"(its sparse CPU path has ReLU only)")
    if model.activation == "fatrelu":
        log.warning("PowerInfer has no FATReLU: it will run this file as plain ReLU (threshold 0); we keep the "
                    "threshold in %s", ACTIVATION_THRESHOLD_KEY)
