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


def _module_name(p: Path) -> str:
    rel = p.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imported(p: Path, modules: set[str]) -> set[str]:
    """The package's modules p imports, at any depth (inside functions and TYPE_CHECKING blocks too)."""
    me = _module_name(p)
    pkg = me if p.name == "__init__.py" else me.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out.update(n for n in names if n in modules and n != me)
    return out


def test_no_import_cycle_between_files_of_one_folder() -> None:
    """Files are split by concept: within a folder, imports go one way (lazy and type-only imports
    count too). A ring of files that import each other is named here."""
    files = {p: _module_name(p) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    modules = set(files.values())
    by_name = {m: p for p, m in files.items()}
    edges = {m: {d for d in _imported(p, modules) if by_name[d].parent == p.parent} for p, m in files.items()}
    rings = []
    for start in sorted(edges):  # a path back to start through same-folder imports is a ring
        seen, todo = set(), [(start, (start,))]
        while todo:
            node, path = todo.pop()
            for nxt in sorted(edges[node]):
                if nxt == start:
                    rings.append(path)
                elif nxt not in seen:
                    seen.add(nxt)
                    todo.append((nxt, (*path, nxt)))
    assert not rings, "files of one folder import each other: " + "; ".join(" -> ".join((*r, r[0])) for r in rings[:10])


def test_no_executor_is_probed_outside_the_factory() -> None:
    """The engine, the API and the tools call the Executor interface (coordinator/executor.py); only
    the factory decides what an executor can be. A getattr/hasattr on an executor, or on an
    executor's GPU handle, anywhere else is a probe the interface should have answered."""
    import re

    probe = re.compile(r"\b(getattr|hasattr)\(\s*[\w.]*(executor|\bex|\.gpu)\b")
    found = [f"{p.relative_to(PACKAGE.parent)}:{i}: {line.strip()}" for p in sorted(PACKAGE.rglob("*.py")) if p.name != "factory.py"
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if probe.search(line)]
    assert not found, "\n".join(found)


def test_protocol_is_the_wire_format_alone() -> None:
    """powerinfer.protocol holds messages, their codec, the transport and its errors; starting,
    watching and restarting processes is powerinfer.processes' and the engine core's. No protocol
    module reaches for processes, threads or signals to act on them."""
    import ast

    acting = {"subprocess", "multiprocessing", "threading", "os", "ctypes"}
    found = []
    for p in sorted((PACKAGE / "protocol").glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{p.name}: {n}" for n in names if n.split(".")[0] in acting]
    assert not found, found


def test_one_sequence_object_from_the_request_to_the_step() -> None:
    """The server's handlers, its scheduler, LLM.generate and the engine core all handle
    coordinator.sequence.Sequence: no second class that wraps or shadows a sequence."""
    import re

    wrapper = re.compile(r"^class (Job|Seq|SequenceState|Request)\b", re.M)
    found = [str(p.relative_to(PACKAGE.parent)) for p in sorted(PACKAGE.rglob("*.py")) if wrapper.search(p.read_text(encoding="utf-8"))]
    assert not found, found


def test_mypy_strict_on_the_coordinator_and_the_native_package(tmp_path: Path) -> None:
    """The Executor protocol and every executor type-check with mypy --strict, and so does the
    native package (C bindings whose ctypes signatures are easy to get wrong)."""
    import sys

    pytest.importorskip("mypy", reason="mypy is a test dependency (pyproject's [test] extra)")
    run = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--cache-dir", str(tmp_path / "cache"),
                          str(PACKAGE / "coordinator"), str(PACKAGE / "native")], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
