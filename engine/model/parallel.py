"""Tensor parallelism inside the model: which slice of each weight a rank holds, and the collectives between ranks.

With N ranks (Megatron's split, as vLLM and nano-vllm do it) each rank holds 1/N of the attention heads (its
q/k/v rows and o_proj columns: column- then row-parallel), 1/N of the MLP (gate/up rows, down columns), 1/N
of every expert's MLP likewise (each rank holds every expert and the whole router, so all ranks route alike)
and 1/N of the vocabulary (embedding and LM head rows). A layer's attention and MLP (dense or experts) each
end in one all-reduce of the hidden states; the embedding in one all-reduce (a token's row lives on one rank,
the others add zeros); the LM head's logits are gathered. With more ranks than KV heads, each KV head is held
by N / kv_heads ranks (replicated, as vLLM does), so a rank's query heads always find their KV head locally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Split:
    """This rank's place among `world` ranks (world 1: no parallelism, no process group)."""

    rank: int = 0
    world: int = 1

    @property
    def parallel(self) -> bool:
        return self.world > 1


ALONE = Split()  # one rank: no parallelism


def check_split(num_heads: int, num_kv_heads: int, mlp_widths: dict[str, int], vocab_size: int, world: int) -> None:
    """Refuses a model that `world` ranks cannot split evenly, naming the numbers. `mlp_widths`: each MLP
    width the model uses, by name (the dense MLP's, an expert's)."""
    problems = []
    if num_heads % world:
        problems.append(f"its {num_heads} attention heads")
    if num_kv_heads % world and world % num_kv_heads:
        problems.append(f"its {num_kv_heads} KV heads (nor does {world} split into them)")
    problems += [f"its {name} {width}" for name, width in mlp_widths.items() if width % world]
    if vocab_size % world:
        problems.append(f"its vocabulary of {vocab_size}")
    if problems:
        raise ValueError(f"tensor_parallel={world} does not divide " + ", ".join(problems))


def kv_heads_per_rank(num_kv_heads: int, world: int) -> int:
    return max(1, num_kv_heads // world)


def kv_head_start(num_kv_heads: int, split: Split) -> int:
    """The first KV head `split`'s rank holds (with more ranks than KV heads, the one its query heads use)."""
    if split.world <= num_kv_heads:
        return split.rank * (num_kv_heads // split.world)
    return split.rank // (split.world // num_kv_heads)


def all_reduce(x: torch.Tensor, split: Split) -> torch.Tensor:
    """The sum of `x` over the ranks, in place."""
    if split.parallel:
        dist.all_reduce(x)
    return x


def gather_columns(x: torch.Tensor, split: Split) -> torch.Tensor:
    """Every rank's `x [rows, cols]` side by side, rank order: `[rows, world * cols]`."""
    if not split.parallel:
        return x
    parts = [torch.empty_like(x) for _ in range(split.world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=1)


def agree_min(values: list[int], device: torch.device, split: Split) -> list[int]:
    """Each of `values` at its smallest over the ranks: what every rank can hold (e.g. KV blocks, which free
    memory decides per device)."""
    if not split.parallel:
        return values
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()
