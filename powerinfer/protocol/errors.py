"""Typed errors of the coordinator <-> worker protocol, shared by both ends.

Runs in: the coordinator and every worker process. Like every PowerInferError, each message is one
line meant for the user (the CLI prints ``error: <message>``).
"""

from __future__ import annotations

import signal

from powerinfer.errors import PowerInferError


class ProtocolError(PowerInferError):
    """A message is malformed, of an unknown type, or breaks a limit of docs/protocol.md.

    ``peer`` is the ROUTER identity of the sender (e.g. ``b"w1"``) when the message was received
    through :func:`~powerinfer.protocol.transport.recv_routed`, else None.
    """

    peer: bytes | None = None


class ProtocolVersionError(ProtocolError):
    """The peer speaks another protocol version (detected on its HELLO)."""

    def __init__(self, peer_version: int, local_version: int) -> None:
        super().__init__(
            f"protocol version mismatch: peer speaks version {peer_version}, this side speaks version "
            f"{local_version} (are the coordinator and workers from the same PowerInfer-Py install?)"
        )
        self.peer_version = peer_version
        self.local_version = local_version


class WorkerDiedError(PowerInferError):
    """A worker process exited, was killed, or stopped answering (no heartbeat in time)."""

    def __init__(self, message: str, *, worker: int | None = None, pid: int | None = None) -> None:
        super().__init__(message)
        self.worker = worker
        self.pid = pid

    @classmethod
    def exited(cls, worker: int, pid: int | None, returncode: int) -> WorkerDiedError:
        """From a process exit status (``Popen.returncode``: negative = killed by that signal)."""
        if returncode < 0:
            try:
                how = f"killed by {signal.Signals(-returncode).name}"
            except ValueError:
                how = f"killed by signal {-returncode}"
        else:
            how = f"exited with status {returncode}"
        return cls(f"{_who(worker, pid)} died: {how}", worker=worker, pid=pid)

    @classmethod
    def silent(cls, worker: int, pid: int | None, seconds: float) -> WorkerDiedError:
        """The worker is alive as a process but sent no heartbeat for ``seconds``."""
        return cls(f"{_who(worker, pid)} stopped answering: no heartbeat for {seconds:.1f}s", worker=worker, pid=pid)


class WorkerError(PowerInferError):
    """A worker reported an ERROR message (the request failed inside the worker)."""

    def __init__(self, message: str, *, worker: int | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.worker = worker
        self.kind = kind

    @classmethod
    def from_report(cls, worker: int, kind: str, text: str, req: int, step: int, layer: int) -> WorkerError:
        """Builds the one-line message from an ERROR body (-1 fields mean "not tied to a request")."""
        where = f" at layer {layer} (req {req}, step {step})" if layer >= 0 else ""
        first_line = text.splitlines()[0] if text else ""
        return cls(f"worker {worker} failed{where}: {kind}: {first_line}", worker=worker, kind=kind)


def _who(worker: int, pid: int | None) -> str:
    return f"worker {worker} (pid {pid})" if pid is not None else f"worker {worker}"
