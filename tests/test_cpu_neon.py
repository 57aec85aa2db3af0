"""The NEON kernels, where this machine is not arm64: the CPU kernels and tests/native/neon_check.c
cross-compiled for arm64 and run under qemu-aarch64, NEON products against the portable ones for every
type (skipped without aarch64-linux-gnu-gcc and qemu-aarch64)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "ember" / "backends" / "cpu" / "csrc"
CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")


@pytest.mark.skipif(not (CC and QEMU), reason="needs aarch64-linux-gnu-gcc and qemu-aarch64")
def test_neon_matches_portable_kernels(tmp_path):
    exe = tmp_path / "neon_check"
    sources = sorted(str(p) for p in CSRC.glob("*.c")) + [str(ROOT / "tests" / "native" / "neon_check.c")]
    subprocess.run([CC, "-O2", "-std=gnu11", "-static", "-pthread", f"-I{CSRC}", *sources, "-lm", "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    out = subprocess.run([QEMU, str(exe)], check=True, capture_output=True, text=True, timeout=600).stdout
    rows = [line.split() for line in out.splitlines()]
    assert len(rows) == 180  # 24 types x 2 k x 3 n, the 32-value types with both roundings
    worst = max(rows, key=lambda r: float(r[4]))
    assert float(worst[4]) <= 1e-5, f"type {worst[0]} k {worst[1]} n {worst[2]} rounding {worst[3]}: {worst[4]}"
