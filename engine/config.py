"""Everything `LLMEngine` can be told, in one place."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention_policy import parse_policy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def model_dtype(name: str, device: str) -> torch.dtype:
    """The weights' dtype for a `dtype` option: "auto" is bf16 on CUDA, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return DTYPES[name]


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype for a `kv_cache_dtype` option: "auto" keeps the model's dtype."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; expected 'auto' or one of {sorted(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


@dataclass
class EngineConfig:
    model: str  # a Hugging Face Qwen3 folder: config.json, *.safetensors, tokenizer files
    device: str = "cpu"
    dtype: str = "auto"  # "auto" (bf16 on CUDA, fp32 on CPU) | "float32" | "bfloat16" | "float16"
    block_size: int = 16  # tokens per KV block
    # The KV pool's ceiling: bytes if > 1, else a fraction of the device memory free once the weights are loaded.
    kv_cache_memory: float = 0.5
    initial_blocks: int = 256  # the pool starts this big (per attention kind) and grows 1.5x when short
    max_num_seqs: int = 256  # sequences in one step
    max_num_batched_tokens: int = 4096  # tokens in one step, decodes and prefill chunks together
    prefill_chunk_size: int = 1024  # the most prompt tokens of one sequence prefilled in a step
    # Priority points a waiting request gains per second, so low-priority work is never starved forever.
    ageing_rate: float = 0.05
    attention_backend: str = "auto"  # "auto" (triton on CUDA when available, else torch) | "torch" | "triton"
    # CPU: decoding sequences also keep dense K/V rows (up to the KV budget again), so decode attention
    # reads views instead of gathering every block at every layer (see engine.dense_decode)
    dense_decode: bool = True
    cuda_graphs: bool = True  # capture decode steps on CUDA (needs a backend that does not sync the host)
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    # Reuse the KV of full blocks across requests with the same prefix (turns of a conversation, shared system
    # prompts); models with sliding-window layers never use it.
    enable_prefix_cache: bool = True
    host_cache_memory: int = 1 << 30  # bytes of host memory for blocks evicted from the prefix cache; 0: none
    # Waiting requests of the same (aged) priority that arrived within this many seconds of each other are
    # admitted longest cached prefix first; a wider window reuses more but lets newcomers overtake for longer.
    cache_aware_window: float = 1.0
    # "auto" (the model's dtype) | "fp8" / "fp8_e4m3": half the KV bytes of bf16, with per-head scales fixed by
    # each layer's first K/V (see engine.kv_cache)
    kv_cache_dtype: str = "auto"
    # which keys full-attention layers see: "dense" | "sliding:W" | "streaming:W:S" | "strided:L:S"
    # (see engine.attention_policy)
    attention_policy: str = "dense"

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs so every running sequence can decode")
        if self.prefill_chunk_size < 1 or self.block_size < 1 or self.initial_blocks < 1:
            raise ValueError("prefill_chunk_size, block_size and initial_blocks must be positive")
        if self.cache_aware_window <= 0 or self.host_cache_memory < 0:
            raise ValueError("cache_aware_window must be positive and host_cache_memory not negative")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"unknown attention backend {self.attention_backend!r}")
        # both raise on a value they do not know
        kv_cache_dtype(self.kv_cache_dtype, torch.float32)
        parse_policy(self.attention_policy)

    @property
    def torch_dtype(self) -> torch.dtype:
        return model_dtype(self.dtype, self.device)

    @property
    def cache_dtype(self) -> torch.dtype:
        return kv_cache_dtype(self.kv_cache_dtype, self.torch_dtype)
