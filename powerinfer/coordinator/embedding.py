"""Token ids to the first residual stream: embedding rows, the model's scale, learned positions.

Runs in: the coordinator process (for the executors that start a pass here: the native decoder in
process and the layer-by-layer ones; the native pool's ranks embed for themselves).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.weights import embed_rows, load_vector

Rows = Callable[[np.ndarray], np.ndarray]  # ids [T] -> embedding rows [T, d] float32, unscaled


class Embedding:
    def __init__(self, f: GGUFFile, cfg: ModelConfig, rows: Optional[Rows] = None) -> None:
        """rows: how to dequantize embedding rows (the native decoder's own); default numpy from the file."""
        self.f, self.scale = f, np.float32(cfg.embed_scale)
        self.rows: Rows = rows if rows is not None else self._file_rows
        self.pos_offset = cfg.pos_offset
        # OPT's learned positions, float32 [rows, d] (a few MiB; row pos + cfg.pos_offset is position pos)
        self.pos_embd = load_vector(f, "position_embd.weight").reshape(-1, cfg.d_model) if cfg.learned_pos else None

    def _file_rows(self, ids: np.ndarray) -> np.ndarray:
        return embed_rows(self.f, ids)

    def __call__(self, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """ids [T], positions [T] int64 -> the residual stream entering layer 0 [T, d] float32 (owned)."""
        x = self.rows(ids)
        if self.scale != 1.0:
            x = x * self.scale
        if self.pos_embd is not None:
            x = x + self.pos_embd[positions + self.pos_offset]
        return x
