"""Supervision of worker processes, one implementation for the CPU pool and the GPU worker.

Runs in: the coordinator process (used by coordinator/pool.py for CPU workers and by
gpu_worker/client.py for the GPU worker).

Sockets live in a private directory (``mkdtemp``: mode 0700) as ``ipc://`` endpoints: a ROUTER
for requests and replies, a PULL for heartbeats. Every worker is started as ``python -m MODULE
INDEX CTL HB COORDINATOR_PID LOG_LEVEL [EXTRA...]`` (parsed by worker_runtime.WorkerArgs): a fresh
interpreter per worker, so no inherited torch thread pools or zmq contexts, and unlike
multiprocessing's spawn it never re-imports the user's ``__main__``. A worker that exits, is
killed, or stops beating (SIGSTOP, a hang) for HEARTBEAT_TIMEOUT_S is a WorkerDiedError for the
request in flight; workers die with the coordinator (PR_SET_PDEATHSIG plus their heartbeat
thread's liveness check), so none is orphaned. A coordinator killed outright cannot remove its
socket directory: a small shell started beside it (``_start_reaper``) removes it within
REAP_INTERVAL_S of the coordinator's death, and the next coordinator to start sweeps any left
anyway (``sweep_stale_dirs``: a reaper killed too, a reboot).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Callable

import zmq

from powerinfer.protocol.errors import ProtocolError, WorkerDiedError, WorkerError
from powerinfer.protocol.messages import HEARTBEAT_TIMEOUT_S, ErrorMsg, HeartbeatMsg, Message, ShutdownMsg
from powerinfer.protocol.transport import recv, recv_routed, send_routed, socket_limits, worker_identity

log = logging.getLogger(__name__)

POLL_MS = 50
LIVENESS_EVERY_S = 0.2  # waitpid per worker costs a syscall: while messages flow, check this often


def describe_exit(code: int | None) -> str:
    """How a process ended, from ``Popen.returncode`` (negative: killed by that signal)."""
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


STALE_AFTER_S = 60.0  # a socket directory this old whose control socket nobody listens on is a dead coordinator's


REAP_INTERVAL_S = 1


def _start_reaper(path: str) -> subprocess.Popen[bytes] | None:
    """A shell, in its own session so a terminal's Ctrl+C or a group kill spares it, that waits
    while this process lives and the directory exists, then removes the directory: what a
    coordinator killed outright (SIGKILL, the OOM killer) cannot do itself. It ends with the
    directory when close() removes it first. None where no shell runs (the sweep still cleans up)."""
    script = f'while kill -0 "$0" 2>/dev/null && [ -d "$1" ]; do sleep {REAP_INTERVAL_S}; done; rm -rf -- "$1"'
    try:
        return subprocess.Popen(["sh", "-c", script, str(os.getpid()), path], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except OSError as e:
        log.debug("no reaper for %s: %s", path, e)
        return None


def sweep_stale_dirs(prefix: str, root: str | None = None) -> list[str]:
    """Remove the socket directories of coordinators that died without cleaning up (SIGKILL, OOM):
    this user's ``<root>/<prefix>*`` directories older than STALE_AFTER_S whose ``ctl`` socket
    refuses a connection (no process listens on it any more). A directory being set up (no
    ``ctl`` yet, or young) and a live coordinator's are left alone. Returns the removed paths."""
    import socket
    import stat

    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        ctl = os.path.join(path, "ctl")
        try:
            st = os.lstat(path)
            if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or time.time() - st.st_mtime < STALE_AFTER_S
                    or not stat.S_ISSOCK(os.lstat(ctl).st_mode)):
                continue
        except OSError:
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(0.5)  # a listener with a full backlog would block a plain connect: count it as live
            try:
                probe.connect(ctl)
                continue  # a live coordinator
            except ConnectionRefusedError:
                pass
            except OSError:
                continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        log.info("removed %d socket directories of coordinators that died: %s", len(removed), ", ".join(removed[:4]))
    return removed


def _layer_error(name: str, msg: ErrorMsg) -> Exception:
    return WorkerError(f"{name} failed on layer {msg.layer}: {msg.kind}: {msg.message}")


class Supervisor:
    """Starts ``n`` workers of ``module`` and supervises them (see the module docstring).

    name(i) is how errors call worker i ("worker 1", "the GPU worker"); extra_args(i) and
    files (name -> text, written into the private directory first; ``{dir}`` in an extra
    argument is replaced by that directory) carry what a worker needs beyond LOAD."""

    def __init__(self, module: str, n: int, log_level: str, name: Callable[[int], str], prefix: str = "powerinfer-",
                 extra_args: Callable[[int], list[str]] = lambda i: [], files: dict[str, str] | None = None) -> None:
        self.name = name
        sweep_stale_dirs(prefix)
        self.dir = tempfile.mkdtemp(prefix=prefix)  # mode 0700: only this user can connect
        # removed by close(), or else when this object is collected or the interpreter exits (an
        # owner that never closed its pool left one directory per pool in /tmp)
        weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)
        self._reaper = _start_reaper(self.dir)
        self._ctx: zmq.Context | None = zmq.Context()
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            self._start(module, n, log_level, extra_args, files or {})
        except BaseException:
            self.close(0.0)
            raise
        self.last_beat = [time.monotonic()] * n
        self._index_of = {worker_identity(i): i for i in range(n)}
        # While starting, interpreters import libraries and pack weights before their first beat;
        # only the caller's start timeout applies until serving is set.
        self.serving = False

    def _start(self, module: str, n: int, log_level: str, extra_args: Callable[[int], list[str]], files: dict[str, str]) -> None:
        assert self._ctx is not None
        self.router = self._ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a dead worker raises, not drops
        socket_limits(self.router)
        endpoint = f"ipc://{self.dir}/ctl"
        self.router.bind(endpoint)
        self.beats = self._ctx.socket(zmq.PULL)
        self.beats.setsockopt(zmq.LINGER, 0)
        socket_limits(self.beats)
        hb_endpoint = f"ipc://{self.dir}/hb"
        self.beats.bind(hb_endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.poller.register(self.beats, zmq.POLLIN)
        for fname, text in files.items():
            with open(os.path.join(self.dir, fname), "w", encoding="utf-8") as fh:
                fh.write(text)
        for i in range(n):
            argv = [sys.executable, "-m", module, str(i), endpoint, hb_endpoint, str(os.getpid()), log_level]
            argv += [a.replace("{dir}", self.dir) for a in extra_args(i)]
            self.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _running(self) -> None:
        if self._ctx is None:  # e.g. a restart whose new workers failed to start left this one closed
            who = f"{self.name(0)} is" if len(self.procs) == 1 else "the workers are"
            raise WorkerDiedError(f"{who} not running (closed, or a restart failed)")

    def send(self, worker: int, msg: Message) -> None:
        self._running()
        try:
            send_routed(self.router, worker_identity(worker), msg)
        except zmq.ZMQError as e:  # ROUTER_MANDATORY: the peer is gone
            # The socket can see the peer gone before waitpid does: wait a moment so the error names the exit.
            p = self.procs[worker]
            try:
                p.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                raise WorkerDiedError(f"{self.name(worker)} (pid {p.pid}) is unreachable: {e}", worker=worker, pid=p.pid) from None
            raise WorkerDiedError(f"{self.name(worker)} (pid {p.pid}) {describe_exit(p.returncode)}", worker=worker, pid=p.pid) from None

    def check_alive(self, pending: set[int], what: str) -> None:
        """Raise WorkerDiedError if a worker in pending exited or (once serving) stopped beating."""
        now = time.monotonic()
        for i in sorted(pending):
            p = self.procs[i]
            if p.poll() is not None:
                raise WorkerDiedError(f"{self.name(i)} (pid {p.pid}) {describe_exit(p.returncode)} while {what}", worker=i, pid=p.pid)
            if self.serving and now - self.last_beat[i] > HEARTBEAT_TIMEOUT_S:
                raise WorkerDiedError(f"{self.name(i)} (pid {p.pid}) stopped answering for {now - self.last_beat[i]:.1f}s while {what}",
                                      worker=i, pid=p.pid)

    def check_health(self, what: str = "idle") -> None:
        """Raise WorkerDiedError if any worker exited or stopped beating; what: the phase the
        error names ("idle" between requests, "running a step" inside one)."""
        self._running()
        self.drain_beats()
        self.check_alive(set(range(len(self.procs))), what)

    def drain_beats(self) -> None:
        while True:
            try:
                msg = recv(self.beats, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except ProtocolError as e:
                log.warning("dropped a malformed heartbeat: %s", e)
                continue
            if isinstance(msg, HeartbeatMsg) and 0 <= msg.worker < len(self.last_beat):
                self.last_beat[msg.worker] = time.monotonic()

    def gather(self, pending: set[int], timeout: float, what: str, req: int | None = None,
               error: Callable[[str, ErrorMsg], Exception] = _layer_error) -> dict[int, Message]:
        """One message from each worker in pending; with req, stale replies are skipped and an
        ERROR raises error(name, msg)."""
        self._running()
        pending = set(pending)
        out: dict[int, Message] = {}
        deadline = time.monotonic() + timeout
        checked = time.monotonic()
        while pending:
            events = dict(self.poller.poll(POLL_MS))
            if self.beats in events:
                self.drain_beats()
            if self.router in events:
                while True:
                    try:
                        ident, msg = recv_routed(self.router, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    idx = self._index_of.get(ident, -1)
                    if idx not in pending:
                        log.debug("ignored a stray %s from %r", type(msg).__name__, ident)
                        continue
                    self.last_beat[idx] = time.monotonic()
                    if req is not None and getattr(msg, "req", req) not in (req, -1):
                        log.debug("ignored a stale reply to request %s", getattr(msg, "req", None))
                        continue
                    if isinstance(msg, ErrorMsg) and req is not None:
                        raise error(self.name(idx), msg)
                    out[idx] = msg
                    pending.discard(idx)
            now = time.monotonic()
            if pending and (not events or now - checked > LIVENESS_EVERY_S):
                checked = now
                self.check_alive(pending, what)
                if now > deadline:
                    names = ", ".join(self.name(i) for i in sorted(pending))
                    raise WorkerDiedError(f"{names} did not answer within {timeout:.0f}s while {what}")
        return out

    def close(self, timeout: float = 3.0, after_send: Callable[[], None] | None = None) -> None:
        """Ask the workers to stop, then kill what is left after timeout; remove the socket directory.
        after_send runs once the SHUTDOWNs are queued (the native pool rings its doorbell there)."""
        if self._ctx is None:
            return
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                try:
                    self.send(i, ShutdownMsg())
                except (zmq.ZMQError, WorkerDiedError):
                    pass
        if after_send is not None:
            after_send()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()  # SIGKILL also ends a SIGSTOPped worker
                p.wait(5.0)
        for sock in (getattr(self, "router", None), getattr(self, "beats", None)):
            if sock is not None:
                sock.close()
        self._ctx.term()
        self._ctx = None
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._reaper is not None:
            # its work is done: ended now (the shell and its sleep, one process group) and reaped,
            # so a long-lived server leaves neither a zombie nor a shell behind per pool restart
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._reaper.pid, signal.SIGKILL)
            self._reaper.wait()
            self._reaper = None
