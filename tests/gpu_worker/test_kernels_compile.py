"""The CUDA sources: they compile with nvcc (no warnings), their block decoders match ggml's formats
bit for bit (run on the host CPU), and the launch signatures the CUDA backend prepares match them.

Runs in: the pytest process (nvcc subprocesses; skipped where nvcc is not on PATH). No GPU needed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from powerinfer.tools.gpu_check import random_weight_rows
from powerinfer.gpu_worker.cuda_backend import SIGNATURES
from powerinfer.gpu_worker.kernels import KERNEL_DIR, SOURCES, SUFFIX, source_files

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
HARNESS = Path(__file__).with_name("dq1_host.cu")
# byte offsets of the float16 scale fields of each block format (random bytes there may be inf/nan)


@needs_nvcc
@pytest.mark.parametrize("src", source_files(), ids=lambda p: p.name)
def test_every_source_compiles_without_warnings(src: Path, tmp_path: Path) -> None:
    assert NVCC is not None
    res = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-Werror", "all-warnings", "-std=c++17", "-I", str(KERNEL_DIR),
                          "-o", str(tmp_path / "out.cubin"), str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "warning" not in (res.stdout + res.stderr).lower(), res.stderr
    assert (tmp_path / "out.cubin").stat().st_size > 0


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    exe = tmp_path_factory.mktemp("dq1") / "dq1_host"
    res = subprocess.run([NVCC, "-Werror", "all-warnings", "-I", str(KERNEL_DIR), "-o", str(exe), str(HARNESS)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return exe


def random_rows(qtype: QT, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, row_bytes]: random codes with finite float16 scales up to 0.1."""
    return random_weight_rows(qtype, n, k, rng, max_scale=0.1)


@pytest.mark.parametrize("qtype", list(SUFFIX), ids=lambda q: q.name)
def test_block_decoders_match_ggml_bit_for_bit(harness: Path, qtype: QT) -> None:
    rng = np.random.default_rng(int(qtype))
    n, k = 5, 768  # three K-quant super-blocks, 24 legacy blocks per row
    raw = random_rows(qtype, n, k, rng)
    res = subprocess.run([str(harness), SUFFIX[qtype], str(k), str(raw.shape[1]), str(n)], input=raw.tobytes(),
                         capture_output=True, check=True)
    got = np.frombuffer(res.stdout, dtype=np.float32).reshape(n, k)
    if qtype in (QT.F16, QT.F32):
        ref = raw.view(np.float16 if qtype == QT.F16 else np.float32).astype(np.float32)
    else:
        ref = dequantize(raw, qtype).reshape(n, k)  # gguf's reference decoder, independent of ours
    np.testing.assert_array_equal(got, ref)


_CODE = {"float": "f", "int": "i", "long long": "q"}


def _param_codes(params: str) -> str:
    codes = []
    for p in params.split(","):
        p = re.sub(r"\b(const|__restrict__|unsigned)\b", " ", p).strip()
        if "*" in p:
            codes.append("P")
            continue
        base = " ".join(p.split()[:-1])  # drop the parameter name
        codes.append(_CODE[base])
    return "".join(codes)


def _kernels_in(text: str) -> dict[str, str]:
    """extern "C" __global__ functions of a source -> their argument type codes."""
    found = {}
    for m in re.finditer(r'extern "C" __global__ void\s+(CAT\(\w+, \w+\)|\w+)\(([^{]*?)\)\s*{', text, re.S):
        found[m.group(1).strip()] = _param_codes(m.group(2))
    return found


def test_prepared_signatures_match_the_sources() -> None:
    declared: dict[str, str] = {}
    template = _kernels_in((KERNEL_DIR / "quant_ops.cuh").read_text())  # CAT(gemv_, SUFFIX) ...
    assert set(template) == {"CAT(gemv_, SUFFIX)", "CAT(axpy_, SUFFIX)"}
    for suffix in SUFFIX.values():
        declared[f"gemv_{suffix}"] = template["CAT(gemv_, SUFFIX)"]
        declared[f"axpy_{suffix}"] = template["CAT(axpy_, SUFFIX)"]
    for src in SOURCES:
        text = (KERNEL_DIR / src.file).read_text()
        declared.update(_kernels_in(text))
        for name in src.functions:
            assert name in declared, f"{name} is not defined by {src.file}"
    listed = {name for src in SOURCES for name in src.functions}
    assert listed == set(declared) == set(SIGNATURES)
    for name, codes in declared.items():
        assert SIGNATURES[name] == codes, f"{name}: backend prepares {SIGNATURES[name]}, the kernel takes {codes}"
