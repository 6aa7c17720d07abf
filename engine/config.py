"""Everything `LLMEngine` can be told, in one place."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention_policy import parse_policy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
SPECULATIVE = ("off", "ngram")  # `speculative`, and a request's `SamplingParams.speculative`


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
    device: str = "auto"  # "auto": CUDA when available, else the CPU
    dtype: str = "auto"  # "auto" (bf16 on CUDA, fp32 on CPU) | "float32" | "bfloat16" | "float16"
    block_size: int = 16  # tokens per KV block
    # The KV pool's ceiling: bytes if > 1, else a fraction of the device memory free once the weights are loaded.
    kv_cache_memory: float = 0.5
    initial_blocks: int = 256  # the pool starts this big (per attention kind) and grows 1.5x when short
    max_num_seqs: int = 256  # sequences in one step
    max_num_batched_tokens: int = 4096  # tokens in one step, decodes and prefill chunks together
    prefill_chunk_size: int = 1024  # the most prompt tokens of one sequence prefilled in a step
    # Priority points a waiting request gains per second (counted from its arrival: the job's creation, when
    # the worker submits it), so low-priority work is never starved forever; see engine.core.scheduler.
    ageing_rate: float = 0.05
    # Latency targets (engine.core.scheduler) for interactive requests (`Request.interactive`: a person waits on
    # each token). A step that carries interactive work takes at most `interactive_slowdown` times what that work
    # alone would take; bulk work fills the rest. `interactive_tpot_ms` / `interactive_ttft_ms` (0: off) replace
    # the slowdown with absolute targets for steps that decode / prefill interactive requests.
    interactive_slowdown: float = 1.5
    interactive_tpot_ms: float = 0.0
    interactive_ttft_ms: float = 0.0
    # For `interactive_window` seconds after an interactive request arrived, steps without interactive work are
    # sized so that their fixed cost is at least `bulk_step_overhead` of them: bulk gives up about that share of
    # its throughput so that an urgent newcomer waits at most fixed cost / overhead for the step in flight.
    # With no interactive traffic, bulk steps have only the token budget.
    bulk_step_overhead: float = 0.05
    interactive_window: float = 30.0
    # Pre-emptions a sequence takes to make room for more urgent newcomers; after that it is left to finish.
    max_preemptions: int = 2
    # Waiting requests of one class and aged priority that arrived within this many seconds of each other are
    # admitted fewest uncached tokens first (short prompts and prefix-cache hits first); a request is never
    # overtaken by one that arrived later than this.
    length_window: float = 30.0
    attention_backend: str = "auto"  # "auto" (triton on CUDA when available, else torch) | "torch" | "triton"
    # CPU: decoding sequences also keep dense K/V rows (up to the KV budget again), so decode attention
    # reads views instead of gathering every block at every layer (see engine.model.dense_decode)
    dense_decode: bool = True
    # CUDA: replay steps of up to 512 tokens from CUDA graphs (engine.model.cuda_graphs); whole decode steps, attention
    # included, need a backend that does not sync the host
    cuda_graphs: bool = True
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    # Reuse the KV of full blocks across requests with the same prefix (turns of a conversation, shared system
    # prompts); models with sliding-window layers never use it.
    enable_prefix_cache: bool = True
    host_cache_memory: int = 1 << 30  # bytes of host memory for blocks evicted from the prefix cache; 0: none
    # "auto" (the model's dtype) | "fp8" / "fp8_e4m3": half the KV bytes of bf16, with per-head scales fixed by
    # each layer's first K/V (see engine.core.kv_cache)
    kv_cache_dtype: str = "auto"
    # which keys full-attention layers see: "dense" | "sliding:W" | "streaming:W:S" | "strided:L:S"
    # (see engine.attention_policy)
    attention_policy: str = "dense"
    # ranks the model is split over (engine.tensor_parallel): its heads, MLP and vocabulary, one device each;
    # it must divide the attention heads, the MLP width and the vocabulary, and the KV heads (or be a multiple)
    tensor_parallel: int = 1
    # A request's grammar (engine.grammar) that takes longer than this to compile fails that request alone; the
    # compile goes on to its end on the compiler's thread and is kept for the next request with that schema.
    # The API bounds schemas so that compiling one takes seconds at worst (jobs.settings' max_schema_*).
    grammar_compile_s: float = 30.0
    # compiled grammars kept for reuse, in bytes (a grammar is a few KB to tens of MB for a 150k vocabulary)
    grammar_cache_bytes: int = 1 << 30
    # Draft-free speculative decoding (engine.core.drafts): "ngram" lets a decoding request carry draft tokens,
    # the text its grammar forces next and tokens copied from after an earlier occurrence of its last
    # `speculative_ngram_min`..`speculative_ngram_max` tokens (prompt and output), up to `speculative_tokens`
    # of them, which one forward verifies; each step proposes only the drafts its fitted cost says are worth it.
    # "off": never. A request's `SamplingParams.speculative` overrides it. The service sets it
    # (CONVOQ_SPECULATIVE, jobs.settings); the other three are knobs.
    speculative: str = "ngram"
    speculative_tokens: int = 8
    speculative_ngram_min: int = 2
    speculative_ngram_max: int = 4
    # The most alternatives a request may ask the log-probabilities of (`SamplingParams.logprobs`); None: up to
    # the vocabulary. Not a knob: the service passes its contract's bound.
    max_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.kv_cache_memory <= 0 or self.max_num_seqs < 1 or self.host_cache_memory < 0:
            raise ValueError("kv_cache_memory must be positive, max_num_seqs at least 1, host_cache_memory not negative")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs so every running sequence can decode")
        if self.prefill_chunk_size < 1 or self.block_size < 1 or self.initial_blocks < 1:
            raise ValueError("prefill_chunk_size, block_size and initial_blocks must be positive")
        if self.length_window <= 0 or self.grammar_compile_s <= 0 or self.grammar_cache_bytes < 0:
            raise ValueError("length_window and grammar_compile_s must be positive, grammar_cache_bytes not negative")
        if self.interactive_slowdown < 1 or not 0 < self.bulk_step_overhead < 1 or self.max_preemptions < 0:
            raise ValueError("interactive_slowdown must be >= 1, bulk_step_overhead in (0, 1), max_preemptions >= 0")
        if self.interactive_tpot_ms < 0 or self.interactive_ttft_ms < 0 or self.interactive_window < 0:
            raise ValueError("interactive_tpot_ms, interactive_ttft_ms and interactive_window must not be negative")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected 'auto' or one of {sorted(DTYPES)}")
        if self.tensor_parallel < 1:
            raise ValueError("tensor_parallel must be at least 1")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"unknown speculative {self.speculative!r}; expected one of {list(SPECULATIVE)}")
        if self.speculative_tokens < 1 or not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError("speculative_tokens must be at least 1, and 1 <= speculative_ngram_min <= "
                             "speculative_ngram_max")
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
