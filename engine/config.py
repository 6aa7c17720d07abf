"""Everything `LLMEngine` can be told, in one place.

Each field's docstring (the string below it) and its entry in `BOUNDS` or `CHOICES` are what the configuration
reference says of the knob (the worker reads each as `CONVOQ_<FIELD>`); `EngineConfig` checks them when it is made.
"""

from __future__ import annotations

import ast
import inspect
import itertools
from dataclasses import dataclass, fields

import torch

from engine.attention_policy import parse_policy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
ATTENTION_BACKENDS = ("auto", "torch", "triton")
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
    model: str  # a Hugging Face folder of a supported family: config.json, *.safetensors, tokenizer files
    device: str = "auto"
    """`auto`: CUDA when available, else the CPU; or a torch device (`cpu`, `cuda`, `cuda:1`)."""
    dtype: str = "auto"
    """The weights' dtype: `auto` is bf16 on CUDA and fp32 on the CPU."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: float = 0.5
    """The KV pool's ceiling: bytes if > 1, else a fraction of the device memory free once the weights are loaded
    (on CUDA after holding back what a forward over the largest step allocates)."""
    initial_blocks: int = 256
    """The KV pool starts this big (per attention kind) and grows 1.5x when short, within its ceiling."""
    max_num_seqs: int = 256
    """Sequences in one step."""
    max_num_batched_tokens: int = 4096
    """Tokens in one step, decodes and prefill chunks together; at least max_num_seqs, so that every running
    sequence can decode."""
    prefill_chunk_size: int = 1024
    """The most prompt tokens of one sequence prefilled in a step."""
    ageing_rate: float = 0.05
    """Priority points a waiting request gains per second (counted from its arrival: the job's creation, when the
    worker submits it), so low-priority work is never starved forever; bulk never ages past interactive."""
    # Latency targets (engine.core.scheduler) for interactive requests (`Request.interactive`: a person waits on
    # each token); bulk work fills the rest of a step.
    interactive_slowdown: float = 1.5
    """A step that carries interactive work takes at most this many times what that work alone would take; bulk
    work fills the rest."""
    interactive_tpot_ms: float = 0.0
    """An absolute target instead of the slowdown (0: off): ms per output token for steps that decode interactive
    requests."""
    interactive_ttft_ms: float = 0.0
    """An absolute target instead of the slowdown (0: off): ms for a step that prefills an interactive prompt."""
    bulk_step_overhead: float = 0.05
    """For `interactive_window` seconds after an interactive request arrived, steps without interactive work are
    sized so that their fixed cost is at least this share of them: bulk gives up about that share of its
    throughput so that an urgent newcomer waits at most fixed cost / overhead for the step in flight. With no
    interactive traffic, bulk steps have only the token budget."""
    interactive_window: float = 30.0
    """Seconds after an interactive request arrived during which bulk steps stay short (`bulk_step_overhead`)."""
    max_preemptions: int = 2
    """Pre-emptions a sequence takes to make room for more urgent newcomers; after that it is left to finish."""
    length_window: float = 30.0
    """Waiting requests of one class and aged priority that arrived within this many seconds of each other are
    admitted fewest uncached tokens first (short prompts and prefix-cache hits first); a request is never
    overtaken by one that arrived later than this."""
    attention_backend: str = "auto"
    """The kernels every layer runs: `auto` (Triton on CUDA when available, else fast plain-PyTorch ops), `torch`,
    or `triton` (on CPU tensors, Triton's interpreter)."""
    dense_decode: bool = True
    """CPU: decoding sequences also keep dense K/V rows (up to the KV budget again), so decode attention reads
    views instead of gathering every block at every layer (engine.model.dense_decode)."""
    cuda_graphs: bool = True
    """CUDA: replay steps of up to 512 tokens from CUDA graphs (engine.model.cuda_graphs); whole decode steps,
    attention included, need a backend that does not sync the host."""
    max_model_len: int | None = None
    """The longest sequence, prompt and output; unset, the model's max_position_embeddings."""
    enable_prefix_cache: bool = True
    """Reuse the KV of full blocks across requests with the same prefix (turns of a conversation, shared system
    prompts); models with sliding-window layers never use it."""
    host_cache_memory: int = 1 << 30
    """Bytes of host memory for blocks evicted from the prefix cache; 0: none."""
    kv_cache_dtype: str = "auto"
    """`auto` (the model's dtype), or `fp8` / `fp8_e4m3`: half the KV bytes of bf16, with per-head scales fixed by
    each layer's first K/V (engine.core.kv_cache)."""
    attention_policy: str = "dense"
    """Which keys full-attention layers see: `dense`, `sliding:W`, `streaming:W:S` (W recent keys plus S attention
    sinks) or `strided:L:S` (L recent keys plus every S-th key); see engine.attention_policy."""
    tensor_parallel: int = 1
    """Devices the model is split over (engine.tensor_parallel): its heads, MLP and vocabulary, one device each;
    it must divide the attention heads, the MLP width and the vocabulary, and the KV heads (or be a multiple)."""
    grammar_compile_s: float = 30.0
    """A request's grammar (engine.grammar) that takes longer than this to compile fails that request alone; the
    compile goes on to its end on the compiler's thread and is kept for the next request with that schema. The
    API bounds schemas so that compiling one takes seconds at worst (CONVOQ_MAX_SCHEMA_*)."""
    grammar_cache_bytes: int = 1 << 30
    """Compiled grammars kept for reuse, in bytes (a grammar is a few KB to tens of MB for a 150k vocabulary)."""
    speculative: str = "ngram"
    """Draft-free speculative decoding (engine.core.drafts): `ngram` lets a decoding request carry draft tokens,
    the text its grammar forces next and tokens copied from after an earlier occurrence of its last
    `speculative_ngram_min`..`speculative_ngram_max` tokens (prompt and output), up to `speculative_tokens` of
    them, which one forward verifies; each step proposes only the drafts its fitted cost says are worth it. `off`:
    never. A request's `SamplingParams.speculative` overrides it. The service sets it (CONVOQ_SPECULATIVE)."""
    speculative_tokens: int = 8
    """The most draft tokens one decoding row carries into a step."""
    speculative_ngram_min: int = 2
    """The fewest last tokens of a request an n-gram draft matches earlier in its prompt and output."""
    speculative_ngram_max: int = 4
    """The most last tokens of a request an n-gram draft matches (the longest match is taken)."""
    # The most alternatives a request may ask the log-probabilities of (`SamplingParams.logprobs`); None: up to
    # the vocabulary. Not a knob: the service passes its contract's bound.
    max_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        for name, bound in BOUNDS.items():
            if not within(getattr(self, name), bound):
                raise ValueError(f"{name} must be {describe(bound)}, not {getattr(self, name)!r}")
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; expected one of {list(choices)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs so every running sequence can decode")
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError("speculative_ngram_min must be at most speculative_ngram_max")
        parse_policy(self.attention_policy)  # raises on a policy it does not know

    @property
    def torch_dtype(self) -> torch.dtype:
        return model_dtype(self.dtype, self.device)

    @property
    def cache_dtype(self) -> torch.dtype:
        return kv_cache_dtype(self.kv_cache_dtype, self.torch_dtype)


# Each numeric knob's bounds, as pydantic names them (ge, gt, le, lt): checked when an EngineConfig is made
BOUNDS: dict[str, dict[str, float]] = {
    **{name: {"ge": 1} for name in ("block_size", "initial_blocks", "max_num_seqs", "max_num_batched_tokens",
                                    "prefill_chunk_size", "interactive_slowdown", "tensor_parallel",
                                    "speculative_tokens", "speculative_ngram_min", "speculative_ngram_max")},
    **{name: {"ge": 0} for name in ("ageing_rate", "interactive_tpot_ms", "interactive_ttft_ms", "interactive_window",
                                    "max_preemptions", "host_cache_memory", "grammar_cache_bytes")},
    **{name: {"gt": 0} for name in ("kv_cache_memory", "length_window", "grammar_compile_s")},
    "bulk_step_overhead": {"gt": 0, "lt": 1},
}
# The knobs that take one of a few names
CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": ("auto", *DTYPES),
    "kv_cache_dtype": ("auto", *KV_CACHE_DTYPES),
    "attention_backend": ATTENTION_BACKENDS,
    "speculative": SPECULATIVE,
}
_WORDS = {"ge": "at least", "gt": "greater than", "le": "at most", "lt": "less than"}


def within(value: float | None, bound: dict[str, float]) -> bool:
    """Whether `value` keeps `bound` (an unset optional knob does)."""
    if value is None:
        return True
    return (bound.get("ge", value) <= value <= bound.get("le", value) and ("gt" not in bound or value > bound["gt"])
            and ("lt" not in bound or value < bound["lt"]))


def describe(bound: dict[str, float]) -> str:
    """`{"gt": 0, "lt": 1}` as "greater than 0 and less than 1"."""
    return " and ".join(f"{_WORDS[op]} {limit:g}" for op, limit in bound.items())


def field_docs(cls: type = EngineConfig) -> dict[str, str]:
    """Each field of a dataclass with a docstring (the string literal right below it), by name."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    names = {f.name for f in fields(cls)}
    return {node.target.id: inspect.cleandoc(after.value.value) for node, after in itertools.pairwise(body)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in names
            and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)}
