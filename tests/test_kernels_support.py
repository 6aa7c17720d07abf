"""Helpers shared by the kernel tests (this module holds no tests itself).

The Triton kernels run on CPU tensors in Triton's interpreter. Triton picks interpreter or compiler when a
function is decorated with `@triton.jit`, and its own library (tl.sum, tl.cdiv, ...) is decorated when Triton
is first imported, which other imports (transformers, torch internals) do long before these tests. So rather
than rely on TRITON_INTERPRET being set early enough, `interpret_kernels` swaps every compiled Triton function
of triton.language and of the kernel modules for an interpreted one while a test module runs, then restores
them, so nothing else in the process sees the change.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from types import ModuleType

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

REL_TOL = 1e-4


def interpret_kernels(*modules: ModuleType) -> Callable:
    """A module-scoped autouse fixture running the kernels of `modules` in Triton's interpreter; assign it to a
    name in the test module."""

    @pytest.fixture(scope="module", autouse=True)
    def interpreted_kernels() -> Iterator[None]:
        languages = [m for name, m in list(sys.modules.items()) if name.startswith("triton.language") and m]
        interpreted: dict[int, InterpretedFunction] = {}
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("TRITON_INTERPRET", "1")
            for module in [*languages, *modules]:
                for name, value in list(vars(module).items()):
                    if isinstance(value, JITFunction):
                        swapped = interpreted.setdefault(id(value), InterpretedFunction(value.fn))
                        patch.setattr(module, name, swapped)
            yield

    return interpreted_kernels


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = REL_TOL) -> None:
    """Largest error relative to the largest expected magnitude, with no NaN anywhere."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert not actual.isnan().any(), "NaN in the output: an element was not written"
    error = (actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp(min=1e-30)
    assert error < rel, f"relative error {error:.2e} >= {rel:.0e}"
