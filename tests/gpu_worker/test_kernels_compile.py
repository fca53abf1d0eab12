"""The CUDA sources: they compile with nvcc (no warnings), their block decoders match ggml's formats
bit for bit and the GEMV kernels match numpy (both run on the host CPU), and the launch signatures
the CUDA backend prepares match them.

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

from powerinfer.devtools.harness.gpu_check import random_weight_rows
from powerinfer.gpu_worker.cuda_backend import SIGNATURES
from powerinfer.gpu_worker.kernels import KERNEL_DIR, SOURCES, SUFFIX, ref_add_rows, ref_gemv, ref_rms_norm_rows, source_files

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
HARNESS = Path(__file__).with_name("dq1_host.cu")
GEMV_HARNESS = Path(__file__).with_name("gemv_host.cu")
RESIDUAL_HARNESS = Path(__file__).with_name("residual_host.cu")
# byte offsets of the float16 scale fields of each block format (random bytes there may be inf/nan)


@pytest.mark.slow
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
@pytest.mark.parametrize("decoder", ["dq1", "dq32"])
def test_block_decoders_match_ggml_bit_for_bit(harness: Path, qtype: QT, decoder: str) -> None:
    """dq1 (weight by weight, the lane kernels) and dq32 (whole blocks, the block GEMV) both give
    ggml's values exactly."""
    rng = np.random.default_rng(int(qtype))
    n, k = 5, 768  # three K-quant super-blocks, 24 legacy blocks per row
    raw = random_rows(qtype, n, k, rng)
    res = subprocess.run([str(harness), SUFFIX[qtype], str(k), str(raw.shape[1]), str(n), *(["dq32"] if decoder == "dq32" else [])],
                         input=raw.tobytes(), capture_output=True, check=True)
    got = np.frombuffer(res.stdout, dtype=np.float32).reshape(n, k)
    if qtype in (QT.F16, QT.F32):
        ref = raw.view(np.float16 if qtype == QT.F16 else np.float32).astype(np.float32)
    else:
        ref = dequantize(raw, qtype).reshape(n, k)  # gguf's reference decoder, independent of ours
    np.testing.assert_array_equal(got, ref)


@pytest.fixture(scope="module")
def gemv_harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _host_exe(tmp_path_factory, GEMV_HARNESS)


# (K, T, ldy extra, x offset in floats, device count or -1, row list): dense batched with strided
# output and an aligned x view (float4 loads); a sparse decode with a device count below the list's
# length and a misaligned x (scalar loads); fewer blocks than lanes
GEMV_CASES = [(1536, 9, 3, 4, -1, False), (1536, 1, 0, 1, 13, True), (512, 3, 0, 0, -1, True)]


@pytest.mark.slow
@pytest.mark.parametrize("qtype", list(SUFFIX), ids=lambda q: q.name)
@pytest.mark.parametrize("kind", ["blocks", "lanes"])
def test_gemv_kernels_run_on_the_host_match_numpy(gemv_harness: Path, qtype: QT, kind: str) -> None:
    """The kernels' own code, a warp at a time on the host (gemv_host.cu), against the float64
    oracle the GPU check uses; float rows also with a width that leaves a tail past the last block."""
    rng = np.random.default_rng(100 + int(qtype))
    cases = GEMV_CASES + ([(1552, 2, 1, 2, -1, False)] if qtype in (QT.F16, QT.F32) else [])
    for k, t, extra, xoff, count, use_rows in cases:
        n_rows = 40
        raw = random_rows(qtype, n_rows, k, rng)
        rows = np.sort(rng.choice(n_rows, 20, replace=False)).astype(np.int32) if use_rows else None
        n = 20 if use_rows else n_rows
        ldy = n + extra
        x = rng.standard_normal(xoff + t * k).astype(np.float32)
        stdin = raw.tobytes() + x.tobytes() + (rows.tobytes() if rows is not None else b"")
        res = subprocess.run([str(gemv_harness), kind, SUFFIX[qtype], str(k), str(raw.shape[1]), str(n_rows), str(n), str(t),
                              str(ldy), str(xoff), str(count), str(int(use_rows))], input=stdin, capture_output=True, check=True)
        got = np.frombuffer(res.stdout, dtype=np.float32).reshape(t, ldy)
        cnt = n if count < 0 else count
        want = ref_gemv(SUFFIX[qtype], raw.ravel(), raw.shape[1], rows, None if count < 0 else np.array([count], np.int32), n,
                        x[xoff:], k, t)
        scale = float(np.max(np.abs(want)))
        assert float(np.max(np.abs(got[:, :cnt] - want))) <= 1e-5 * scale, (k, t, xoff, count)
        assert not got[:, cnt:].any(), "wrote past the count or into the stride"


def _host_exe(tmp_path_factory: pytest.TempPathFactory, src: Path) -> Path:
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    exe = tmp_path_factory.mktemp(src.stem) / src.stem
    res = subprocess.run([NVCC, "-std=c++20", "-Werror", "all-warnings", "-I", str(KERNEL_DIR), "-o", str(exe), str(src)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return exe


@pytest.fixture(scope="module")
def residual_harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _host_exe(tmp_path_factory, RESIDUAL_HARNESS)


@pytest.mark.parametrize("t,d,ldx,ldy", [(1, 576, 576, 576), (5, 100, 130, 101), (3, 17, 17, 20)])
def test_residual_kernels_run_on_the_host_match_numpy(residual_harness: Path, t: int, d: int, ldx: int, ldy: int) -> None:
    """rms_norm_rows (a warp per token, rows wider and narrower than a warp, strided in and out) and
    add_rows, the kernels of a run of layers on the device, against the engine's own float32 norm."""
    rng = np.random.default_rng(t * d)
    x = rng.standard_normal(t * ldx).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    res = subprocess.run([str(residual_harness), "norm", str(t), str(d), str(ldx), str(ldy), "1e-6"], input=x.tobytes() + w.tobytes(),
                         capture_output=True, check=True)
    got = np.frombuffer(res.stdout, dtype=np.float32).reshape(t, ldy)
    np.testing.assert_allclose(got[:, :d], ref_rms_norm_rows(x, ldx, t, d, w, 1e-6), rtol=2e-6, atol=2e-6)
    assert not got[:, d:].any()
    y = rng.standard_normal(t * ldy).astype(np.float32)
    res = subprocess.run([str(residual_harness), "add", str(t), str(d), str(ldx), str(ldy)], input=x.tobytes() + y.tobytes(),
                         capture_output=True, check=True)
    want = y.copy()
    ref_add_rows(want, ldy, x, ldx, t, d)
    np.testing.assert_array_equal(np.frombuffer(res.stdout, dtype=np.float32), want)


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
    assert set(template) == {"CAT(gemv_, SUFFIX)", "CAT(gemv_lanes_, SUFFIX)", "CAT(axpy_, SUFFIX)"}
    for suffix in SUFFIX.values():
        for kind in ("gemv", "gemv_lanes", "axpy"):
            declared[f"{kind}_{suffix}"] = template[f"CAT({kind}_, SUFFIX)"]
    for src in SOURCES:
        text = (KERNEL_DIR / src.file).read_text()
        declared.update(_kernels_in(text))
        for name in src.functions:
            assert name in declared, f"{name} is not defined by {src.file}"
    listed = {name for src in SOURCES for name in src.functions}
    assert listed == set(declared) == set(SIGNATURES)
    for name, codes in declared.items():
        assert SIGNATURES[name] == codes, f"{name}: backend prepares {SIGNATURES[name]}, the kernel takes {codes}"
