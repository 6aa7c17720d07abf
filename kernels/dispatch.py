"""The one place that picks the kernels: Triton on CUDA, fast plain-PyTorch ops on CPU, or the references.

The engine asks once, `ops = select_ops(backend, device, head_dim)`, then calls `ops.paged_attention(...)`,
`ops.store_kv(...)`, `ops.rms_norm(...)`, `ops.add_rms_norm(...)`, `ops.qk_norm_rope(...)`, `ops.swiglu(...)`,
`ops.fused_moe(...)` (a mixture-of-experts layer's experts) and, for FP8 checkpoints, `ops.fp8_linear(...)` and
`ops.fp8_fused_moe(...)`; every set takes the same arguments and gives the same results, but for the FP8 ops
where a device has no FP8 tensor cores: there the weights are dequantized for each matmul and the activations
stay unquantized (`kernels.fp8_gemm.dequant_linear`; of the experts, only those some token chose). Three sets
exist: the Triton kernels, their PyTorch references (the readable ground truth) and `kernels.torch_ops` (the
references organised for speed, for CPUs). Importing this module imports no Triton: ask for the ops at run
time, not at import time, since Triton's interpreter mode (tests) is fixed when Triton is first imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Ops:
    backend: str  # "triton", "reference" or "torch"
    paged_attention: Callable[..., torch.Tensor]
    store_kv: Callable[..., None]
    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    qk_norm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    swiglu: Callable[..., torch.Tensor]
    fused_moe: Callable[..., torch.Tensor]
    fp8_linear: Callable[..., torch.Tensor]
    fp8_fused_moe: Callable[..., torch.Tensor]


def reference_ops() -> Ops:
    from kernels import attention_ref, fp8_gemm, fused_moe_ref, qk_norm_rope, rms_norm, swiglu

    return Ops(
        backend="reference",
        paged_attention=attention_ref.paged_attention_ref,
        store_kv=attention_ref.store_kv_ref,
        rms_norm=rms_norm.rms_norm_ref,
        add_rms_norm=rms_norm.add_rms_norm_ref,
        qk_norm_rope=qk_norm_rope.qk_norm_rope_ref,
        swiglu=swiglu.swiglu_ref,
        fused_moe=fused_moe_ref.fused_moe_ref,
        fp8_linear=fp8_gemm.fp8_linear_ref,
        fp8_fused_moe=fused_moe_ref.fp8_fused_moe_ref,
    )


def triton_ops() -> Ops:
    """The Triton kernels. They take CUDA tensors, or CPU tensors when TRITON_INTERPRET=1 was set before
    Triton was first imported (Triton's interpreter: slow, for tests)."""
    from kernels import attention, fp8_gemm, fused_moe, kv_store, qk_norm_rope, rms_norm, swiglu

    return Ops(
        backend="triton",
        paged_attention=attention.paged_attention,
        store_kv=kv_store.store_kv,
        rms_norm=rms_norm.rms_norm,
        add_rms_norm=rms_norm.add_rms_norm,
        qk_norm_rope=qk_norm_rope.qk_norm_rope,
        swiglu=swiglu.swiglu,
        fused_moe=fused_moe.fused_moe,
        fp8_linear=fp8_gemm.fp8_linear,
        fp8_fused_moe=fused_moe.fp8_fused_moe,
    )


def get_ops(device: torch.device | str, force_reference: bool = False) -> Ops:
    """Triton on a CUDA device unless `force_reference`; the PyTorch references on any other device."""
    if torch.device(device).type == "cuda" and not force_reference:
        return triton_ops()
    return reference_ops()


def select_ops(backend: str, device: torch.device | str, head_dim: int, scaled_kv: bool = False) -> Ops:
    """The kernels for an engine's `attention_backend`: "auto" takes Triton on CUDA when the shapes allow and
    `torch_ops` elsewhere, "torch" forces `torch_ops`, "triton" forces Triton on any device (CPU tensors run in
    Triton's interpreter: tests). `scaled_kv`: the K/V cache is fp8 with per-head scales."""
    if backend == "triton":
        return _fp8_for(triton_ops(), device)
    # the Triton attention kernels take power-of-two head dims of at least 16
    triton_shapes = head_dim >= 16 and head_dim & (head_dim - 1) == 0
    ops = get_ops(device, force_reference=backend == "torch" or not triton_shapes)
    if ops.backend == "triton":
        return _fp8_for(ops, device)
    from kernels import fp8_gemm, torch_ops

    # torch_ops' experts ask the host how many rows each expert has, which no CUDA graph can hold: on CUDA the
    # experts run the Triton kernels whatever the other ops are (their shapes are not the attention kernels')
    experts = _fp8_for(triton_ops(), device) if torch.device(device).type == "cuda" else torch_ops
    fast = replace(ops, backend="torch", rms_norm=torch_ops.rms_norm, add_rms_norm=torch_ops.add_rms_norm,
                   qk_norm_rope=torch_ops.qk_norm_rope, fused_moe=experts.fused_moe,
                   fp8_fused_moe=experts.fp8_fused_moe, fp8_linear=fp8_gemm.dequant_linear)
    if scaled_kv:  # the fast CPU attention reads unscaled caches only; the references dequantize fp8
        return fast
    return replace(fast, paged_attention=torch_ops.paged_attention, store_kv=torch_ops.store_kv)


def _fp8_for(ops: Ops, device: torch.device | str) -> Ops:
    """The Triton set's W8A8 FP8 ops where `device` has FP8 tensor cores, else the dequantizing ones."""
    from kernels import fp8_gemm, fused_moe

    if fp8_gemm.has_fp8_tensor_cores(device):
        return ops
    return replace(ops, fp8_linear=fp8_gemm.dequant_linear, fp8_fused_moe=fused_moe.dequant_fused_moe)
