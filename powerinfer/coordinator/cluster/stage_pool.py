"""A pipeline stage's native pool: the ranks of one node run the stage's layers, the stream in and out through the segment.

Runs in: a stage's actor process (coordinator/cluster/stage.py), which is this pool's coordinator.

The pool is the default executor's (coordinator/native_pool.py: NUMA-pinned ranks, each a slice of
every layer, merging in shared memory), made with ``layers``: its ranks build only the stage's
layers, and a step's residual stream enters through the segment's hidden area (the STEP's
STEP_STREAM flag; stage 0 embeds token ids as the whole model's pool does). Rank 0 answers in the
same area: the stream leaving the stage's last layer, or, at the model's last layer, the final
hidden states and every rank's columns of the logits.
"""

from __future__ import annotations

import numpy as np

from powerinfer.coordinator.executor import Batch, Want
from powerinfer.coordinator.logits import REFINE, REFINE_MARGIN, answer
from powerinfer.coordinator.native_pool import NativePoolExecutor
from powerinfer.errors import InvalidArgumentError
from powerinfer.native.decoder_lib import STEP_STREAM


class StagePool(NativePoolExecutor):
    """A native pool of one pipeline stage's layers (made with ``layers=(first, stop)``)."""

    def execute_stream(self, x: np.ndarray | None, batch: Batch) -> np.ndarray:
        """A pipeline stage's step (the pool was made with layers): x [T, d], the residual stream
        entering its first layer (None: batch.ids, the first stage) -> the stream leaving its last
        layer [T, d]; when that is the model's last layer, what batch.want asks for instead."""
        assert self.layers is not None, "execute_stream needs a pool of a stage's layers"
        T = len(batch)
        if not 1 <= T <= self.max_tokens:
            raise InvalidArgumentError(f"a stage's step takes 1..{self.max_tokens} tokens")
        stream = STEP_STREAM if x is not None else 0
        ids = np.zeros(T, dtype=np.int64) if x is not None else batch.ids
        if x is not None:
            if x.shape != (T, self.cfg.d_model):
                raise InvalidArgumentError(f"a stage's stream is [{T}, {self.cfg.d_model}], got {list(x.shape)}")
            self._seg.hidden[:T] = x
        want = batch.want
        if self.layers[1] == self.cfg.n_layers and (want is Want.LAST or (want is Want.EACH and T <= self.logit_rows)):
            self._step(ids, batch.positions, batch.slots, (2 if want is Want.EACH else 1) | stream)
            return self._refined(T, want is Want.EACH, REFINE_MARGIN, REFINE)
        self._step(ids, batch.positions, batch.slots, stream)
        hidden = np.array(self._seg.hidden[:T])
        if self.layers[1] != self.cfg.n_layers:
            return hidden
        return answer(want, hidden, self.cfg.vocab_size, self.logits, self.refine, self.decode_logits)
