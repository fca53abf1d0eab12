"""The slow first-run steps say one line each at the commands' default log level, with stderr not
a terminal (a log file, CI, a pipe): the C build here; the model fetch and a PowerInfer file's
runnable copy log through the same logger (issue 33)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CODE = """
import sys
from pathlib import Path
from powerinfer.flags import configure_logging
from powerinfer.native.build import load_library
configure_logging(sys.argv[2], False)
src = Path(sys.argv[1])
lib = load_library(src, (), ("-O1", "-shared", "-fPIC"), "phasetest")
print(lib.seven())
"""


def _build(tmp_path: Path, level: str) -> subprocess.CompletedProcess[str]:
    src = tmp_path / "tiny.c"
    src.write_text("int seven(void) { return 7; }\n")
    env = {"POWERINFER_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", CODE, str(src), level], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=env)


def test_the_c_build_is_said_at_the_default_level(tmp_path: Path) -> None:
    first = _build(tmp_path, "WARNING")
    assert first.returncode == 0 and first.stdout.strip() == "7", first.stderr
    assert "compiling tiny.c, once for this machine" in first.stderr
    again = _build(tmp_path, "WARNING")  # cached: nothing to say
    assert again.returncode == 0 and "compiling" not in again.stderr


def test_log_level_error_silences_it(tmp_path: Path) -> None:
    r = _build(tmp_path, "ERROR")
    assert r.returncode == 0 and "compiling" not in r.stderr, r.stderr
