"""What pip resolves from the README's install line, checked offline against local package indexes.

Runs in: the pytest process, which runs `pip install --dry-run --report` in subprocesses.

This machine reaches neither PyPI's torch files nor PyTorch's CPU index, so the two are stood in for
by folders of tiny wheels with the same names and versions: a "PyPI" whose `torch 2.13.0` requires a
CUDA library (as PyPI's wheel requires cuDNN and NCCL), and a "CPU index" with `torch 2.13.0+cpu` and
no such requirement. The README's flags (`torch==2.13.0 ... --extra-index-url <cpu index>`) must give
the CPU build, and the same line must still work where pip's own index is a mirror that holds the CPU
wheel and the PyTorch index cannot be reached.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _add_wheel(index: Path, name: str, version: str, requires: list[str]) -> None:
    """Writes a minimal wheel into index/files and links it from index/simple/<name>/index.html
    (the PEP 503 page pip reads for a file:// index)."""
    dist = f"{name.replace('-', '_')}-{version}"  # a wheel's file name spells the project with underscores
    wheel = index / "files" / f"{dist}-py3-none-any.whl"
    wheel.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{name.replace('-', '_')}/__init__.py", "")
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    page = index / "simple" / name / "index.html"
    page.parent.mkdir(parents=True, exist_ok=True)
    with page.open("a") as f:
        f.write(f'<a href="../../files/{wheel.name}">{wheel.name}</a>\n')


def _resolve(tmp_path: Path, index: Path, extra: str) -> list[tuple[str, str]]:
    """(name, version) of everything `pip install --dry-run` would install for the README's torch pin."""
    report = tmp_path / f"report-{len(list(tmp_path.glob('report-*')))}.json"
    cmd = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", "install", "--dry-run",
           "--ignore-installed", "--retries", "0", "--timeout", "2", "--report", str(report), _readme_torch_pin(),
           "--index-url", (index / "simple").as_uri(), "--extra-index-url", extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return sorted((i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"])


def _readme_torch_pin() -> str:
    """The torch requirement of the README's quick-start line, which must name PyTorch's CPU index."""
    readme = (ROOT / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("python3 -m pip install torch=="))
    assert f"--extra-index-url {CPU_INDEX}" in line, line
    pin = re.search(r"torch==[0-9.]+", line)
    assert pin is not None
    return pin.group(0)


@pytest.fixture()
def indexes(tmp_path: Path) -> tuple[Path, Path]:
    version = _readme_torch_pin().split("==")[1]
    pypi, cpu = tmp_path / "pypi", tmp_path / "cpu"
    _add_wheel(pypi, "torch", version, ["nvidia-cudnn-cu13"])
    _add_wheel(pypi, "nvidia-cudnn-cu13", "9.13.0", [])
    _add_wheel(cpu, "torch", f"{version}+cpu", [])
    return pypi, cpu


def test_the_cpu_index_gives_the_cpu_build(tmp_path: Path, indexes: tuple[Path, Path]) -> None:
    pypi, cpu = indexes
    version = _readme_torch_pin().split("==")[1]
    # without the CPU index, PyPI's build and its CUDA library: what the README's line avoids
    assert _resolve(tmp_path, pypi, pypi.joinpath("simple").as_uri()) == [("nvidia-cudnn-cu13", "9.13.0"), ("torch", version)]
    # with it, the local version `+cpu` sorts above the public one and nothing CUDA comes along
    assert _resolve(tmp_path, pypi, (cpu / "simple").as_uri()) == [("torch", f"{version}+cpu")]


def test_a_mirror_holding_the_cpu_wheel_still_serves_it(tmp_path: Path, indexes: tuple[Path, Path]) -> None:
    """pip's index is a mirror that carries the CPU wheel; PyTorch's index cannot be reached (a closed port)."""
    _, cpu = indexes
    version = _readme_torch_pin().split("==")[1]
    assert _resolve(tmp_path, cpu, "http://127.0.0.1:9/whl/cpu") == [("torch", f"{version}+cpu")]
