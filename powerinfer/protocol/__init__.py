"""Wire protocol between the coordinator and worker processes: ZeroMQ multipart messages with a
msgpack header frame and raw tensor frames (spec: docs/protocol.md).

Runs in: the coordinator and every worker process. Import from here, not from the submodules.
"""

from __future__ import annotations

from powerinfer.protocol.errors import (
    ProtocolError,
    ProtocolVersionError,
    WorkerDiedError,
    WorkerError,
)
from powerinfer.protocol.codec import (
    DTYPES,
    decode,
    encode,
)
from powerinfer.protocol.messages import (
    DEFAULT_MAX_MSG,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    MAX_BODY,
    MAX_DIMS,
    MAX_LIST,
    MAX_STR,
    PROTOCOL_VERSION,
    ZERO_COPY_MIN,
    AttnMsg,
    LayersMsg,
    ErrorMsg,
    FfnMsg,
    LogitsMsg,
    HeartbeatMsg,
    HelloMsg,
    LoadMsg,
    Message,
    MsgType,
    PartialMsg,
    ReadyMsg,
    ResultMsg,
    ShutdownMsg,
    StepMsg,
    KvMsg,
)
from powerinfer.protocol.transport import (
    as_torch,
    recv,
    recv_routed,
    send,
    send_routed,
    socket_limits,
    worker_identity,
)

__all__ = [
    "DEFAULT_MAX_MSG",
    "DTYPES",
    "HEARTBEAT_INTERVAL_S",
    "HEARTBEAT_TIMEOUT_S",
    "MAX_BODY",
    "MAX_DIMS",
    "MAX_LIST",
    "MAX_STR",
    "PROTOCOL_VERSION",
    "ZERO_COPY_MIN",
    "AttnMsg",
    "LayersMsg",
    "ErrorMsg",
    "FfnMsg",
    "LogitsMsg",
    "HeartbeatMsg",
    "HelloMsg",
    "LoadMsg",
    "Message",
    "MsgType",
    "PartialMsg",
    "ProtocolError",
    "ProtocolVersionError",
    "ReadyMsg",
    "ResultMsg",
    "ShutdownMsg",
    "StepMsg",
    "KvMsg",
    "WorkerDiedError",
    "WorkerError",
    "as_torch",
    "decode",
    "encode",
    "recv",
    "recv_routed",
    "send",
    "send_routed",
    "socket_limits",
    "worker_identity",
]
