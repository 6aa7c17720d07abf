"""The one place that picks the kernels: Triton for CUDA tensors, the PyTorch references elsewhere.

The engine asks once, `ops = get_ops(device)`, then calls `ops.paged_attention(...)`, `ops.store_kv(...)`,
`ops.rms_norm(...)`, `ops.add_rms_norm(...)`, `ops.qk_norm_rope(...)` and `ops.swiglu(...)`; both backends take
the same arguments and give the same results. Importing this module imports no Triton: ask for the ops at run
time, not at import time, since Triton's interpreter mode (tests) is fixed when Triton is first imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ops:
    backend: str  # "triton" or "reference"
    paged_attention: Callable[..., torch.Tensor]
    store_kv: Callable[..., None]
    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    qk_norm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    swiglu: Callable[..., torch.Tensor]


def reference_ops() -> Ops:
    from kernels import attention_ref, qk_norm_rope, rms_norm, swiglu

    return Ops(
        backend="reference",
        paged_attention=attention_ref.paged_attention_ref,
        store_kv=attention_ref.store_kv_ref,
        rms_norm=rms_norm.rms_norm_ref,
        add_rms_norm=rms_norm.add_rms_norm_ref,
        qk_norm_rope=qk_norm_rope.qk_norm_rope_ref,
        swiglu=swiglu.swiglu_ref,
    )


def triton_ops() -> Ops:
    """The Triton kernels. They take CUDA tensors, or CPU tensors when TRITON_INTERPRET=1 was set before
    Triton was first imported (Triton's interpreter: slow, for tests)."""
    from kernels import attention, kv_store, qk_norm_rope, rms_norm, swiglu

    return Ops(
        backend="triton",
        paged_attention=attention.paged_attention,
        store_kv=kv_store.store_kv,
        rms_norm=rms_norm.rms_norm,
        add_rms_norm=rms_norm.add_rms_norm,
        qk_norm_rope=qk_norm_rope.qk_norm_rope,
        swiglu=swiglu.swiglu,
    )


def get_ops(device: torch.device | str, force_reference: bool = False) -> Ops:
    """Triton on a CUDA device unless `force_reference`; the PyTorch references on any other device."""
    if torch.device(device).type == "cuda" and not force_reference:
        return triton_ops()
    return reference_ops()
