"""Test helper: a synthetic ReGLU model with a predictor file sparse enough for the native rule.

Runs in: the pytest process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from powerinfer.config import config_from_gguf
from powerinfer.gguf_file import GGUFFile
from powerinfer.predictors.predictor_file import write_predictor
from powerinfer.predictors.predictor_types import PredictorFile
from tests.gpu_worker.helpers import make_predictor


def sparse_relu_model(make_model: Callable[..., Path], out: Path, n_layers: int) -> tuple[Path, PredictorFile, Path]:
    """(the model, its predictor, the predictor's file in out): fewer neurons active than the native
    rule's cut for running a layer dense (a quarter), as calibrated and as predicted."""
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=n_layers, activation="relu")
    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    pf = make_predictor(f, cfg, "predictor")
    pf = replace(pf, layers=tuple(replace(lp, fc2_b=np.full(cfg.n_ff, -2.5, np.float32), act_freq=np.full(cfg.n_ff, 0.1, np.float32))
                                  for lp in pf.layers))
    write_predictor(out / "m.predictor", pf)
    return path, pf, out / "m.predictor"
