"""The package's shape: the import layers (.importlinter, checked by import-linter), no source
file over 400 lines, and no module importing another's private names.

Runs in: the pytest process (reads the source files as text and syntax trees; lint-imports in a
process of its own).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "powerinfer"
MAX_LINES = 400


def test_import_layers() -> None:
    """entry points -> tools -> api -> coordinator -> workers -> foundations, the two worker packages
    independent: a cycle or an upward import fails here (the contract names what is not listed yet)."""
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    r = subprocess.run([exe], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_no_source_file_over_400_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in sorted(PACKAGE.rglob("*")) if p.suffix in (".py", ".c", ".h", ".cu", ".cuh")
            and (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"split these files (lines): {long}"


def test_no_module_imports_another_modules_private_names() -> None:
    found = []
    for p in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "powerinfer":
                found += [f"{p.relative_to(PACKAGE)}:{node.lineno} {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, "private names imported across modules: " + ", ".join(found)


def test_ci_runs_the_readmes_install_and_test_command() -> None:
    """.ci/run is the README's test command (its CPU-torch install line included), not a variant."""
    root = PACKAGE.parent
    readme = (root / "README.md").read_text()
    ci_line = (root / ".ci" / "run").read_text().rstrip().splitlines()[-1]
    assert "pytest" in ci_line and "download.pytorch.org/whl/cpu" in ci_line
    assert f"```sh\n{ci_line}\n```" in readme
