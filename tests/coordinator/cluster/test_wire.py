"""Stage messages: a msgpack header and raw frames round-trip; what does not match is refused.

Runs in: the test process (no Ray).
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from powerinfer.coordinator.cluster.wire import StageMsg, decode, heartbeat, heartbeat_stage
from powerinfer.protocol import ProtocolError


def _msg(payload: np.ndarray, kind: str = "hidden") -> StageMsg:
    return StageMsg(7, 1, 2, "each", kind, np.arange(3, dtype=np.int64), np.array([0, 1, 1]), payload)


@pytest.mark.parametrize("payload", [np.arange(6, dtype=np.float32).reshape(3, 2), np.zeros(0, dtype=np.float32),
                                     np.array([5, 6, 7], dtype=np.int64)])
def test_round_trip(payload: np.ndarray) -> None:
    m = decode([bytes(f) for f in _msg(payload).frames()])
    assert (m.step, m.mb, m.n_mb, m.want, m.kind) == (7, 1, 2, "each", "hidden")
    assert m.payload.dtype == payload.dtype and np.array_equal(m.payload, payload)
    assert m.positions.tolist() == [0, 1, 2] and m.slots.tolist() == [0, 1, 1]
    assert heartbeat_stage(heartbeat(3)) == 3


def test_what_does_not_match_its_header_is_refused() -> None:
    frames = [bytes(f) for f in _msg(np.ones((3, 2), dtype=np.float32)).frames()]
    with pytest.raises(ProtocolError, match="4 frames"):
        decode(frames[:3])
    with pytest.raises(ProtocolError, match="do not match"):
        decode([*frames[:3], frames[3][:-4]])
    head = msgpack.unpackb(frames[0])
    with pytest.raises(ProtocolError, match="wire version 99"):
        decode([msgpack.packb({**head, "v": 99}), *frames[1:]])
    for bad in ({"dtype": "object"}, {"kind": "pickle"}, {"shape": [-1, 2]}, {"step": "7"}):
        with pytest.raises(ProtocolError):
            decode([msgpack.packb({**head, **bad}), *frames[1:]])
    with pytest.raises(ProtocolError):
        heartbeat_stage(b"\xc1")
