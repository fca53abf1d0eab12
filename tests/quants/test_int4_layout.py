"""torch's int4 packing read back under every CPU capability torch can dispatch to here: the layout
differs (AVX512, AVX2, none), and dequantized() feeds the sparse down projections, so a wrong
reading is silently wrong output on another machine (CI ran the AVX2 layout once)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from powerinfer.quants.int4_layout import unpack_int4

PROBE = """
import torch
from powerinfer.quants.int4_layout import unpack_int4
for n in (16, 48, 64, 80, 96, 208):
    codes = torch.randint(0, 16, (n, 96), generator=torch.Generator().manual_seed(n), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(unpack_int4(packed, n, 96).to(torch.int32), codes), n
print(torch.backends.cpu.get_cpu_capability())
"""


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_unpacking_inverts_torchs_packing(capability: str) -> None:
    r = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, "ATEN_CPU_CAPABILITY": capability}, capture_output=True,
                       text=True, timeout=120)
    # (a capability the CPU lacks falls back to a lower one: still a layout read back)
    assert r.returncode == 0, r.stderr[-2000:]


def test_in_this_process() -> None:
    codes = torch.randint(0, 16, (144, 64), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(unpack_int4(packed, 144, 64).to(torch.int32), codes)
