"""The shared worker life cycle: the coordinator's Supervisor and the workers' run_worker, with
the real worker modules (CPU and GPU) started through them.

Runs in: the pytest process plus the worker processes each test starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from powerinfer.protocol import HelloMsg, ShutdownMsg, WorkerDiedError
from powerinfer.processes.supervisor import Supervisor, describe_exit, sweep_stale_dirs
from powerinfer.processes.worker_runtime import WorkerArgs


def test_worker_args_round_trip_and_usage() -> None:
    a = WorkerArgs.parse(["2", "ipc:///x/ctl", "ipc:///x/hb", "77", "DEBUG", "/x/setup.json"])
    assert a == WorkerArgs(2, "ipc:///x/ctl", "ipc:///x/hb", 77, "DEBUG", ("/x/setup.json",))
    assert WorkerArgs.parse(["0", "c", "h", "1"]).log_level == "WARNING"
    with pytest.raises(SystemExit, match="started by the coordinator"):
        WorkerArgs.parse(["0", "c"])


def test_describe_exit() -> None:
    assert describe_exit(None) == "stopped answering"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(3) == "exited with status 3"


def test_a_worker_that_exits_while_starting_is_named() -> None:
    # The GPU worker without its setup file exits at once: the supervisor names it and its exit.
    sup = Supervisor("powerinfer.gpu_worker.worker", 1, "WARNING", lambda i: "the GPU worker")
    try:
        with pytest.raises(WorkerDiedError, match=r"the GPU worker \(pid \d+\) exited with status 1 while starting"):
            sup.gather({0}, 60.0, "starting")
    finally:
        sup.close()
    assert not Path(sup.dir).exists()


def test_both_worker_kinds_say_hello_and_stop_on_shutdown() -> None:
    # CPU workers and the GPU worker run the same runtime: HELLO with their pid, SHUTDOWN before
    # LOAD ends them cleanly, and the setup file reaches the GPU worker through the private directory.
    sups = [Supervisor("powerinfer.cpu_workers.worker", 2, "WARNING", lambda i: f"worker {i}"),
            Supervisor("powerinfer.gpu_worker.worker", 1, "WARNING", lambda i: "the GPU worker",
                       extra_args=lambda i: ["{dir}/setup.json"], files={"setup.json": "{}"})]
    try:
        for sup in sups:
            hellos = sup.gather(set(range(len(sup.procs))), 60.0, "starting")
            assert all(isinstance(m, HelloMsg) and m.pid == p for m, p in zip((hellos[i] for i in sorted(hellos)), sup.pids))
            assert (Path(sup.dir) / "setup.json").exists() == (len(sup.procs) == 1)
            for i in range(len(sup.procs)):
                sup.send(i, ShutdownMsg())
            for p in sup.procs:
                assert p.wait(30) == 0
    finally:
        for sup in sups:
            sup.close()


def test_a_killed_worker_is_noticed_between_requests() -> None:
    sup = Supervisor("powerinfer.cpu_workers.worker", 1, "WARNING", lambda i: f"worker {i}")
    try:
        sup.gather({0}, 60.0, "starting")
        sup.serving = True
        os.kill(sup.pids[0], signal.SIGKILL)
        sup.procs[0].wait(10)
        with pytest.raises(WorkerDiedError, match=r"worker 0 \(pid \d+\) killed by SIGKILL while idle") as e:
            sup.check_health()
        assert e.value.worker == 0 and e.value.pid == sup.pids[0]
    finally:
        sup.close()
    # closed (e.g. a restart that failed left it so): every use is a WorkerDiedError, which the
    # engine's and the server's failure paths handle, never a raw ZMQError
    for use in (sup.check_health, lambda: sup.send(0, ShutdownMsg()), lambda: sup.gather({0}, 1.0, "idle")):
        with pytest.raises(WorkerDiedError, match="worker 0 is not running"):
            use()


def test_an_unclosed_pool_leaves_no_socket_directory() -> None:
    # An owner that never calls close(): the directory goes when the interpreter exits (it used to
    # stay in /tmp, one per pool); the worker, its coordinator gone, exits by itself.
    code = ("import sys\nfrom powerinfer.processes.supervisor import Supervisor\n"
            "s = Supervisor('powerinfer.cpu_workers.worker', 1, 'WARNING', lambda i: 'worker')\n"
            "s.gather({0}, 60.0, 'starting')\nprint(s.dir, s.pids[0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert len(out) == 2 and out[0].startswith(tempfile.gettempdir()) and not Path(out[0]).exists()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{out[1]}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{out[1]}").exists(), "the orphaned worker kept running"


def test_the_next_coordinator_removes_a_dead_ones_socket_directory(tmp_path: Path) -> None:
    """A coordinator killed outright leaves its private directory (its ctl socket file, nobody
    listening); one being set up, a young one and a live one stay."""
    import socket

    def make(name: str, listening: bool | None, age_s: float) -> tuple[Path, socket.socket | None]:
        d = tmp_path / name
        d.mkdir(mode=0o700)
        sock = None
        if listening is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(d / "ctl"))
            if listening:
                sock.listen(1)
            else:
                sock.close()  # the file stays, nobody listens: a killed coordinator's
                sock = None
        os.utime(d, (time.time() - age_s, time.time() - age_s))
        return d, sock

    dead, _ = make("powerinfer-dead1234", False, 600)
    young, _ = make("powerinfer-young123", False, 5)
    live, server = make("powerinfer-live1234", True, 600)
    setting_up, _ = make("powerinfer-setup123", None, 600)
    other, _ = make("other-dead1234", False, 600)
    try:
        assert sweep_stale_dirs("powerinfer-", str(tmp_path)) == [str(dead)]
    finally:
        assert server is not None
        server.close()
    assert not dead.exists() and young.exists() and live.exists() and setting_up.exists() and other.exists()


def test_a_sigkilled_coordinator_leaves_no_socket_directory() -> None:
    """SIGKILL (the OOM killer, kill -9 of a server) runs no cleanup in the coordinator: its reaper
    shell removes the directory within a second or two; the worker dies with the coordinator."""
    code = ("import sys, time\nfrom powerinfer.processes.supervisor import Supervisor\n"
            "s = Supervisor('powerinfer.cpu_workers.worker', 1, 'WARNING', lambda i: 'worker')\n"
            "s.gather({0}, 60.0, 'starting')\nprint(s.dir, s.pids[0], flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        folder, worker = proc.stdout.readline().split()
        assert Path(folder).is_dir()
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 15
        while (Path(folder).exists() or Path(f"/proc/{worker}").exists()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(folder).exists(), "the killed coordinator's socket directory stayed"
        assert not Path(f"/proc/{worker}").exists(), "the worker outlived its coordinator"
    finally:
        proc.kill()


def test_a_closed_pool_ends_its_reaper() -> None:
    sup = Supervisor("powerinfer.cpu_workers.worker", 1, "WARNING", lambda i: "worker")
    reaper = sup._reaper
    sup.close()
    # ended and reaped by close() itself: no shell or zombie per pool restart in a long-lived server
    assert reaper is not None and reaper.returncode is not None and sup._reaper is None
