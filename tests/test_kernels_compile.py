"""Every Triton kernel compiles for Hopper (sm_90) with Triton's bundled ptxas, no GPU needed, without spills.

Runs in a fresh process: the interpreter tests swap Triton's compiled functions for interpreted ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build ships no ptxas")
def test_kernels_compile_for_hopper():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "kernels.compile_check", "--arch", "90"],
        capture_output=True, text=True, env=env, cwd=Path(__file__).parents[1], timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 21
    assert all("stack_bytes=0 " in line for line in lines), result.stdout
