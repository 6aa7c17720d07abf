"""One Triton kernel against its PyTorch reference: whether this machine can run the engine's kernels.

    python -m engine.kernel_probe

Run in a process of its own (`convoq doctor`), so that a kernel that hangs or crashes takes only it along. On a
CPU it runs in Triton's interpreter (`TRITON_INTERPRET=1`). Its last line says what it found; it exits 0 when
the kernel agrees with its reference.
"""

from __future__ import annotations

import os
import sys

import torch

from kernels.rms_norm import rms_norm, rms_norm_ref

TOLERANCE = 1e-3


def probe() -> tuple[str, bool]:
    """What the kernel did, in a line, and whether it agrees with its reference."""
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    x = torch.randn(8, 256, device=device)
    weight = torch.randn(256, device=device)
    error = (rms_norm(x, weight, 1e-6) - rms_norm_ref(x, weight, 1e-6)).abs().max().item()
    return f"rms_norm on {device}: max error {error:.2e} against its reference", error < TOLERANCE


if __name__ == "__main__":
    line, agrees = probe()
    print(line)
    sys.exit(0 if agrees else 1)
