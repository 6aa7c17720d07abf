"""The fused gate/up matmul with SiLU-multiply epilogue against `swiglu_ref`, in Triton's interpreter (fp32)."""

from __future__ import annotations

import pytest
import torch

from kernels import scaled_dot, swiglu
from tests.test_kernels_support import assert_close, interpret_kernels

interpreted_kernels = interpret_kernels(swiglu, scaled_dot)


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize(("shape", "intermediate"), [((1, 32), 24), ((37, 64), 48), ((70, 48), 40), ((2, 5, 32), 16)])
def test_matches_reference(shape, intermediate):
    gen = torch.Generator().manual_seed(intermediate)
    x = torch.randn(shape, generator=gen)
    w_gate_up = torch.randn(2 * intermediate, shape[-1], generator=gen) / shape[-1] ** 0.5
    assert_close(swiglu.swiglu(x, w_gate_up), swiglu.swiglu_ref(x, w_gate_up))


def test_rejects_odd_stacked_weight():
    with pytest.raises(ValueError, match="even"):
        swiglu.swiglu(torch.randn(2, 8), torch.randn(5, 8))
