"""Triton paged attention (decode and extend, dense and block-sparse, fp32 and fp8 caches) against the
PyTorch reference, run by Triton's interpreter on CPU in fp32.

Each case poisons everything the kernels must not read: cache slots nobody wrote are NaN, and blocks the
pattern never reads are -1 in the block table, as a ring-recycled sliding-window layer has them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels import attention, torch_ops
from kernels.attention_ref import paged_attention_ref, store_kv_ref, visible
from kernels.sparse import AttentionPolicy
from tests.test_kernels_support import assert_close, interpret_kernels

interpreted_kernels = interpret_kernels(attention)

FP8 = torch.float8_e4m3fn


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    scale: float
    policy: AttentionPolicy
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def run(self, fn, policy: AttentionPolicy | None = None) -> torch.Tensor:
        policy = policy or self.policy
        return fn(
            self.q, self.k_cache, self.v_cache, self.cu_seqlens_q, self.seq_lens, self.block_tables, self.scale,
            policy.window, policy.sinks, stride=policy.stride, k_scale=self.k_scale, v_scale=self.v_scale,
        )


def make_case(
    new: list[int],
    lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    policy: AttentionPolicy,
    cache_dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    batch = len(lens)
    width = -(-max(lens) // block_size) + 1  # a spare column of -1, as tables padded to the longest have
    num_blocks = batch * width + 3
    physical = torch.randperm(num_blocks, generator=gen).view(-1)[: batch * width].view(batch, width).int()
    tables = torch.full((batch, width), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan")).to(cache_dtype)
    v_cache = torch.full(shape, float("nan")).to(cache_dtype)
    quantized = cache_dtype == FP8
    k_scale = torch.rand(kv_heads, generator=gen) + 0.01 if quantized else None
    v_scale = torch.rand(kv_heads, generator=gen) + 0.01 if quantized else None
    for b, (n, length) in enumerate(zip(new, lens, strict=True)):
        positions = torch.arange(length)
        read = visible(positions[length - n:], positions, policy.window, policy.sinks, policy.stride).any(0)
        read_blocks = torch.zeros(width, dtype=torch.bool)
        read_blocks[: -(-length // block_size)] = torch.nn.functional.pad(read, (0, -length % block_size)).view(
            -1, block_size
        ).any(1)
        tables[b] = torch.where(read_blocks, physical[b], -1)
        slots = tables[b].repeat_interleave(block_size)[:length] * block_size + positions % block_size
        slots = torch.where(tables[b].repeat_interleave(block_size)[:length] >= 0, slots, -1)
        k = torch.randn(length, kv_heads, head_dim, generator=gen)
        v = torch.randn(length, kv_heads, head_dim, generator=gen)
        store_kv_ref(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), heads, head_dim, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return Case(q, k_cache, v_cache, cu, seq_lens, tables, head_dim**-0.5, policy, k_scale, v_scale)


DENSE = AttentionPolicy.dense()
# (new tokens, sequence lengths, heads, kv heads, head_dim, block_size, policy)
DECODE = [
    ([1, 1, 1], [1, 17, 100], 8, 8, 32, 16, DENSE),
    ([1, 1, 1], [33, 64, 99], 8, 2, 32, 16, DENSE),
    ([1, 1], [50, 7], 8, 1, 64, 8, DENSE),
    ([1, 1], [100, 41], 8, 2, 16, 16, AttentionPolicy.sliding(24)),
    ([1, 1], [100, 41], 16, 2, 16, 16, AttentionPolicy.streaming(20, 5)),
    ([1], [97], 4, 4, 32, 16, AttentionPolicy.sliding(200)),
    ([1, 1], [90, 60], 4, 1, 16, 8, AttentionPolicy.local_strided(12, 10)),
]
EXTEND = [
    ([20, 5, 1], [20, 40, 77], 8, 8, 32, 16, DENSE),
    ([37, 16], [100, 16], 8, 2, 32, 16, DENSE),
    ([60], [90], 8, 1, 16, 8, DENSE),
    ([30, 3, 9], [70, 50, 9], 8, 2, 16, 16, AttentionPolicy.sliding(10)),
    ([45, 2], [95, 33], 8, 1, 16, 16, AttentionPolicy.streaming(16, 4)),
    ([64], [64], 4, 4, 32, 16, AttentionPolicy.sliding(64)),
    ([40, 20], [80, 20], 4, 2, 16, 8, AttentionPolicy.local_strided(8, 16)),
]


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("shape", DECODE + EXTEND, ids=lambda s: f"new{s[0]}-len{s[1]}-h{s[2]}/{s[3]}-d{s[4]}-{s[6]}")
def test_matches_reference(shape):
    case = make_case(*shape)
    assert_close(case.run(attention.paged_attention), case.run(paged_attention_ref))


def torch_ops_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, window, sinks, stride,
                        k_scale=None, v_scale=None):
    return torch_ops.paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, window, sinks,
                                     stride)


# decodes beside rows verifying drafts, as a CPU step with drafts has them on a pool without dense rows
MIXED = [
    ([1, 5, 1, 1, 3], [40, 77, 18, 99, 30], 8, 2, 32, 16, DENSE),
    ([1, 4, 1], [100, 41, 60], 8, 2, 16, 16, AttentionPolicy.sliding(24)),
    ([6, 1, 1], [90, 60, 33], 4, 1, 16, 8, AttentionPolicy.local_strided(12, 10)),
]


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("shape", DECODE + EXTEND + MIXED, ids=lambda s: f"new{s[0]}-len{s[1]}-{s[6]}")
def test_cpu_ops_match_reference(shape):
    """The CPU ops gather whole blocks and mask what they must not see, so slots nobody wrote hold stale finite
    bytes here (as a pool reused by other sequences has them), not NaN."""
    case = make_case(*shape)
    case.k_cache, case.v_cache = case.k_cache.nan_to_num(7.0), case.v_cache.nan_to_num(-7.0)
    assert_close(case.run(torch_ops_attention), case.run(paged_attention_ref))


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize(
    "shape",
    [([1, 1], [70, 19], 8, 2, 32, 16, DENSE), ([25, 4], [60, 30], 4, 1, 16, 8, AttentionPolicy.streaming(12, 4))],
    ids=["decode", "extend-streaming"],
)
def test_fp8_cache_matches_reference(shape):
    """The kernels read e4m3 directly and apply the per-head scales; the reference dequantizes first."""
    case = make_case(*shape, cache_dtype=FP8, seed=3)
    assert_close(case.run(attention.paged_attention), case.run(paged_attention_ref))


@pytest.mark.parametrize(("new", "lens"), [([1, 1], [45, 80]), ([30, 80], [45, 80])], ids=["decode", "extend"])
def test_window_covering_the_sequence_equals_dense(new, lens):
    case = make_case(new, lens, 4, 2, 16, 16, DENSE)
    dense = case.run(attention.paged_attention)
    for policy in (AttentionPolicy.sliding(80), AttentionPolicy.streaming(200, 7)):
        windowed = case.run(attention.paged_attention, policy)
        if new == [1, 1]:  # decode may slice the same tiles into a different number of splits
            torch.testing.assert_close(windowed, dense, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(windowed, dense)


def test_query_tiles_cover_every_token_once():
    cu = torch.tensor([0, 5, 5, 40, 41], dtype=torch.int32)  # an empty sequence among them
    block_m = 16
    seq, tok, count = attention.query_tiles(cu, block_m, num_rows=41 // block_m + 4)
    covered = torch.cat([torch.arange(t, t + c) for t, c in zip(tok.tolist(), count.tolist(), strict=True)])
    assert torch.equal(covered, torch.arange(41))
    owner = torch.searchsorted(cu[1:].long(), covered, right=True)
    assert torch.equal(seq.long().repeat_interleave(count.long()), owner)


def test_rejects_unsupported_head_dim():
    case = make_case([1], [10], 2, 2, 16, 16, DENSE)
    with pytest.raises(ValueError, match="head_dim"):
        attention.paged_attention(case.q[..., :12], case.k_cache, case.v_cache, case.cu_seqlens_q, case.seq_lens,
                                  case.block_tables, 1.0)
