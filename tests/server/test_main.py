"""`powerinfer-server` / `powerinfer serve` argument handling: one-line errors, before any model loads."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from powerinfer.cli.main import main as cli_main
from powerinfer.server.main import main


def test_port_in_use_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert main(["-m", "missing.gguf", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err == f"error: port {port} on 127.0.0.1 is already in use (another server?); choose another with --port\n"


@pytest.mark.parametrize("args, message, status", [  # 2: a usage error, as argparse's; 1: the machine cannot
    (["--port", "70000"], "--port must be in 0..65535", 2),
    (["--queue", "-1"], "--queue must be >= 0", 2),
    (["-c", "-5"], "--ctx-size must be >= 0", 2),
    (["--api-key", " "], "--api-key must not be empty", 2),
    (["-ngl", "4"], "need an NVIDIA GPU", 1),
])
def test_bad_values(args: list[str], message: str, status: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-m", "x.gguf", *args]) == status
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_serve_subcommand_and_help() -> None:
    out = subprocess.run([sys.executable, "launch.py", "serve", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--parallel" in out and "--api-key" in out and "usage: powerinfer serve" in out
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--parallel", "0", "-m", "x"])
    assert e.value.code == 2


@pytest.mark.parametrize("trained, expected", [(65536, 16384), (8192, 8192)])
def test_server_context_default(make_model, trained: int, expected: int) -> None:  # type: ignore[no-untyped-def]
    """Without -c the server takes 16384 positions (Open WebUI's built-in tools alone are ~6.6k tokens),
    capped by the model; the library and the one-shot CLI keep llama.cpp's 4096."""
    from powerinfer.cli.main import build_generate_parser
    from powerinfer.flags import load_llm
    from powerinfer.server.main import build_parser

    path = str(make_model(context_length=trained))
    llm = load_llm(build_parser().parse_args(["-m", path, "--executor", "inprocess"]), progress=False)
    try:
        assert llm.n_ctx == expected
    finally:
        llm.close()
    assert build_generate_parser().parse_args(["-m", path]).default_ctx == 4096


@pytest.mark.parametrize("content", [None, b"hello, not a model\n"])
def test_a_model_that_cannot_load_stops_the_server(tmp_path, content: bytes | None) -> None:  # type: ignore[no-untyped-def]
    """A missing file or a text file named .gguf: one error line and exit 1 within 5 s, nothing left
    running (a supervisor with Restart=on-failure sees the failure instead of a server answering 503)."""
    import time

    import psutil

    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_bytes(content)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "powerinfer.server.main", "-m", str(path), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = proc.pid
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 5.0
    assert proc.returncode == 1
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(path) in errors[0], err
    assert "Traceback" not in err
    assert not any(str(path) in " ".join(p.info["cmdline"] or []) and p.pid != pid
                   for p in psutil.process_iter(["cmdline"]) if p.pid != psutil.Process().pid)
