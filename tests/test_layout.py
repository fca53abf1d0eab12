"""The package's shape: no source file over 400 lines, and no module importing another's private
names (issue 19's rules that a test can hold today; the layer contract comes with import-linter).

Runs in: the pytest process (reads the source files as text and syntax trees; imports nothing).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "powerinfer"
MAX_LINES = 400


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
