"""Without the cluster flags nothing changes and Ray is never imported; asked for without Ray
installed, the flags say what to install.

Runs in: the test process and a fresh interpreter per check.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from gguf import GGMLQuantizationType as QT

from powerinfer.coordinator.cluster.options import ClusterOptions
from powerinfer.errors import InvalidArgumentError


def test_a_run_and_the_clis_help_never_import_ray(make_model: Callable[..., Path]) -> None:
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=2)
    code = ("import sys, contextlib, io\n"
            "from powerinfer.api import LLM\n"
            "from powerinfer.cli.main import main\n"
            f"with LLM({str(path)!r}, executor='inprocess', n_ctx=64) as llm:\n"
            "    assert llm.complete([1, 2, 3], 4, temperature=0)[1] in ('stop', 'length')\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    main(['--help'])\n"
            "assert '--ray-address' in out.getvalue(), out.getvalue()[-500:]\n"
            "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_cluster_options_are_checked() -> None:
    import pytest

    for bad, match in ((ClusterOptions(stages=0), "pipeline-stages"), (ClusterOptions(placement="ring"), "ray-placement"),
                       (ClusterOptions(threads=0), "threads")):
        with pytest.raises(InvalidArgumentError, match=match):
            bad.check()


def test_the_flags_without_ray_installed_say_what_to_install(make_model: Callable[..., Path]) -> None:
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=2)
    code = ("import sys\n"
            "sys.modules['ray'] = None  # as if Ray were not installed\n"
            "from powerinfer.api import LLM\n"
            "from powerinfer.coordinator.cluster.options import ClusterOptions\n"
            "from powerinfer.errors import InvalidArgumentError\n"
            "try:\n"
            f"    LLM({str(path)!r}, n_ctx=64, cluster=ClusterOptions(stages=2))\n"
            "except InvalidArgumentError as e:\n"
            "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "pip install 'powerinfer[ray]'" in r.stdout, r.stdout + r.stderr[-2000:]
