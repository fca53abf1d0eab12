"""Activation sparsity: neuron predictors, their ``.predictor`` files, calibration and profiling.

Runs in: the CLI process (calibration), the coordinator and CPU workers (reading predictors).

Only the torch-free file formats are re-exported here, so importing the package stays cheap;
calibration and profiling live in their own modules (``powerinfer.sparsity.calibrate``, ...).
"""

from powerinfer.predictors.powerinfer_formats import (
    GpuSplit,
    is_powerinfer_file,
    open_powerinfer_gguf,
    read_gpuidx,
    read_powerinfer_predictor,
)
from powerinfer.predictors.predictor_file import (
    LayerPredictor,
    PredictorFile,
    model_fingerprint,
    read_predictor,
    validate_predictor,
    write_predictor,
)

__all__ = [
    "GpuSplit",
    "LayerPredictor",
    "PredictorFile",
    "is_powerinfer_file",
    "model_fingerprint",
    "open_powerinfer_gguf",
    "read_gpuidx",
    "read_powerinfer_predictor",
    "read_predictor",
    "validate_predictor",
    "write_predictor",
]
