"""Prefix reuse: identical outputs with and without the cache, shared blocks never freed while in use,
conversations coming back from the host tier without recomputation, and requests of different cache salts
sharing nothing, in either tier."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.core.block_key import ROOT, BlockKey, salt_root
from engine.core.host_cache import HostCache
from engine.core.kv_cache import KVCache
from engine.core.prefix_cache import PrefixCache
from engine.interface import Request, RequestError
from engine.llm_engine import LLMEngine
from tests.engine_helpers import greedy, kv_block_bytes, make_engine, prompts, run_all

pytestmark = pytest.mark.usefixtures("single_thread")


def check_blocks(engine: LLMEngine, seen: dict[int, tuple[int, torch.Tensor]]) -> None:
    """Reference counts match the live block tables, no block is both free and cached, and a cached block's
    K/V never changes while it stays cached (`seen`: block -> (key, K/V when first seen cached))."""
    pool, prefix = engine.blocks.pools[0], engine.blocks.prefix
    refs = [0] * pool.capacity
    for seq in [*engine.scheduler.running, *engine.scheduler.waiting]:
        for block in seq.block_tables[0]:
            refs[block] += 1
    assert refs == pool.ref_counts
    free, parked = set(pool.free), set(prefix.parked)
    assert len(free) == len(pool.free) and not free & parked and not free & set(prefix.entries)
    assert all(refs[b] == 0 for b in free | parked)
    for block in [b for b in seen if b not in prefix.entries]:
        del seen[block]  # evicted: the block may now hold anything
    for block, entry in prefix.entries.items():
        data = torch.empty(pool.cache.block_shape())
        pool.cache.read_block(block, data)
        if block in seen and seen[block][0] == entry.key:
            # not exact: a block evicted and recomputed with the same tokens in one step differs by rounding
            assert torch.allclose(seen[block][1], data, rtol=0, atol=1e-4), f"block {block} was overwritten"
        else:
            seen[block] = (entry.key, data.clone())


def converse(engine: LLMEngine, system: list[int], conversations: int, turns: int, seed: int,
             check=None) -> list[list[int]]:
    """`conversations` chats of `turns` turns, all at once turn by turn; each turn's prompt is the previous
    one, the reply and a new user message. Returns every reply in order."""
    rng = random.Random(seed)
    history = [list(system) for _ in range(conversations)]
    replies = []
    for turn in range(turns):
        requests = []
        for c in rng.sample(range(conversations), conversations):
            history[c] += prompts(1, 5, 20, seed=rng.randrange(1 << 30))[0]
            requests.append(Request(f"c{c}-t{turn}", list(history[c]), greedy(rng.randint(4, 12)),
                                    conversation_id=f"c{c}"))
        done = run_all(engine, requests, check)
        for request in requests:
            reply = done[request.request_id].token_ids
            history[int(request.conversation_id[1:])] += reply
            replies.append(reply)
    return replies


def assert_reuse_gives_the_tokens_of_no_reuse(path: Path, block_bytes: int, reference: Path | None = None) -> None:
    """Four five-turn conversations on one system prompt, two at a time in a pool of 40 blocks of
    `block_bytes`: the same replies with the prefix cache as without it on `reference` (by default the same
    folder), most prompt tokens served from it."""
    system = prompts(1, 40, 40, seed=5)[0]
    small = dict(kv_cache_memory=40 * block_bytes, initial_blocks=8, max_num_seqs=2, max_num_batched_tokens=64)
    reference = converse(make_engine(reference or path, enable_prefix_cache=False, **small), system, 4, 5, seed=1)
    engine = make_engine(path, **small)
    assert converse(engine, system, 4, 5, seed=1) == reference
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens > 0.4 * stats.prefix_cache_queries_tokens


def test_ten_turn_conversations_match_without_cache(tiny_model):
    system = prompts(1, 40, 40, seed=5)[0]
    # six conversations of up to 15 blocks, two at a time, in a 40-block pool: blocks go to the host and back
    small = dict(kv_cache_memory=40 * kv_block_bytes(tiny_model), initial_blocks=8, max_num_seqs=2,
                 max_num_batched_tokens=64)
    reference = converse(make_engine(tiny_model, enable_prefix_cache=False, **small), system, 6, 10, seed=1)
    engine = make_engine(tiny_model, **small)
    seen: dict[int, tuple[int, torch.Tensor]] = {}
    assert converse(engine, system, 6, 10, seed=1, check=lambda e: check_blocks(e, seen)) == reference
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens > 0.5 * stats.prefix_cache_queries_tokens
    assert stats.evictions > 100 and stats.host_hit_tokens > 0


def test_shared_system_prompt_many_concurrent_sequences(tiny_model):
    system = prompts(1, 100, 100, seed=3)[0]
    users = prompts(24, 1, 40, seed=4)
    requests = lambda: [Request(str(i), system + u, greedy(10)) for i, u in enumerate(users)]  # noqa: E731
    budget = dict(kv_cache_memory=60 * kv_block_bytes(tiny_model), initial_blocks=8,
                  max_num_batched_tokens=256, prefill_chunk_size=64, host_cache_memory=0)
    reference = run_all(make_engine(tiny_model, enable_prefix_cache=False, **budget), requests())
    engine = make_engine(tiny_model, **budget)
    seen: dict[int, tuple[int, torch.Tensor]] = {}
    done = run_all(engine, requests(), lambda e: check_blocks(e, seen))
    assert {k: c.token_ids for k, c in done.items()} == {k: c.token_ids for k, c in reference.items()}
    stats = engine.stats()
    # the six blocks of the system prompt were computed once (or again after pre-emption), not per request
    assert stats.tokens_computed < engine.stats().prefix_cache_queries_tokens - 18 * 96
    # only the first request computed the prompt: the others waited a step rather than prefill it alongside
    assert sorted(c.timings.prompt_tokens_reused >= 96 for c in done.values()) == [False] + [True] * 23
    assert stats.kv_blocks_used == 0 and engine.blocks.pools[0].num_cached > 0


def test_returning_conversation_comes_back_from_host(tiny_model):
    engine = make_engine(tiny_model, kv_cache_memory=24 * kv_block_bytes(tiny_model), initial_blocks=8)
    first = prompts(1, 160, 160, seed=7)[0]
    reply = run_all(engine, [Request("a1", first, greedy(8), conversation_id="a")])["a1"].token_ids
    # other traffic fills the pool and pushes conversation a's blocks out to the host tier
    run_all(engine, [Request(f"x{i}", ids, greedy(4)) for i, ids in enumerate(prompts(4, 150, 170, seed=8))])
    assert engine.stats().evictions >= 10
    computed = engine.stats().tokens_computed
    second = first + reply + prompts(1, 9, 9, seed=9)[0]  # 10 blocks cached: the 11th was not full
    done = run_all(engine, [Request("a2", second, greedy(4), conversation_id="a")])["a2"]
    assert done.timings.prompt_tokens_reused == done.timings.host_tokens_reused == 160
    stats = engine.stats()
    assert stats.tokens_computed - computed == len(second) - 160 + 3  # one prompt token, then 3 decodes
    assert stats.host_prefetch_hit_rate == 1.0
    cold = make_engine(tiny_model, enable_prefix_cache=False)
    assert run_all(cold, [Request("a2", second, greedy(4))])["a2"].token_ids == done.token_ids


def test_requests_of_different_salts_share_no_block(tiny_model):
    engine = make_engine(tiny_model)
    prompt = prompts(1, 160, 160, seed=11)[0]  # ten full blocks: nine can be reused, the last token never is

    def ask(request_id: str, salt: bytes | str | None) -> tuple[int, int, list[int]]:
        """(prompt tokens reused, tokens computed for it, its output) of `prompt` sent under `salt`."""
        computed = engine.stats().tokens_computed
        done = run_all(engine, [Request(request_id, list(prompt), greedy(4), cache_salt=salt)])[request_id]
        return done.timings.prompt_tokens_reused, engine.stats().tokens_computed - computed, done.token_ids

    reused, computed, first = ask("a1", "tenant:a")
    assert (reused, computed) == (0, 160 + 3)
    # another salt, or none, is told of nothing and recomputes the whole prompt
    for i, salt in enumerate((b"tenant:b", "tenant:", None)):
        assert ask(f"b{i}", salt) == (0, 160 + 3, first)
    # the same salt, as str or as its bytes, reuses as before
    for i, salt in enumerate(("tenant:a", b"tenant:a")):
        assert ask(f"a{i + 2}", salt) == (144, 16 + 3, first)
    assert engine.stats().prefix_cache_hit_tokens == 2 * 144


def test_the_host_tier_serves_a_block_only_to_its_salt(tiny_model):
    engine = make_engine(tiny_model, kv_cache_memory=24 * kv_block_bytes(tiny_model), initial_blocks=8)
    first = prompts(1, 160, 160, seed=7)[0]
    reply = run_all(engine, [Request("a1", first, greedy(8), cache_salt="tenant:a")])["a1"].token_ids
    # other traffic pushes the tenant's blocks out to the host tier
    run_all(engine, [Request(f"x{i}", ids, greedy(4), cache_salt="tenant:x")
                     for i, ids in enumerate(prompts(4, 150, 170, seed=8))])
    assert engine.stats().evictions >= 10
    second = first + reply + prompts(1, 9, 9, seed=9)[0]
    host_hits = engine.stats().host_hit_tokens
    other = run_all(engine, [Request("b2", second, greedy(4), cache_salt="tenant:b")])["b2"]
    assert other.timings.prompt_tokens_reused == other.timings.host_tokens_reused == 0
    assert engine.stats().host_hit_tokens == host_hits
    own = run_all(engine, [Request("a2", second, greedy(4), cache_salt="tenant:a")])["a2"]
    assert own.timings.prompt_tokens_reused == own.timings.host_tokens_reused == 160
    assert own.token_ids == other.token_ids


def test_a_cache_salt_that_is_neither_bytes_nor_str_is_refused(tiny_model):
    engine = make_engine(tiny_model)
    with pytest.raises(RequestError, match="cache_salt must be bytes or str, not int"):
        engine.add_request(Request("r", prompts(1, 40, 40)[0], greedy(4), cache_salt=7))
    assert not engine.has_unfinished()


def test_entries_whose_keys_collide_stay_apart_in_both_tiers():
    """A key another salt's request crafted to equal a block's (a 64-bit hash of tokens can be made to collide)
    neither finds that block nor keeps it out of either tier."""
    cache = KVCache(num_layers=1, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                    device=torch.device("cpu"))
    prefix = PrefixCache(HostCache(cache, max_blocks=4))
    ours, theirs = (BlockKey(7, ROOT, (5, 6), salt_root(salt)) for salt in ("tenant:a", "tenant:b"))
    assert prefix.insert(0, ours) and prefix.insert(1, theirs)
    assert (prefix.lookup(ours), prefix.lookup(theirs)) == (0, 1)
    for block in (0, 1):
        cache.write_block(block, torch.full(cache.block_shape(), float(block + 1)))
        prefix.park(block)
    assert (prefix.evict(), prefix.evict()) == (0, 1)  # both spilled to the host tier
    assert prefix.lookup(ours) is None and prefix.host.contains(ours) and prefix.host.contains(theirs)
    prefix.host.load(theirs, 3)
    back = torch.empty(cache.block_shape())
    cache.read_block(3, back)
    assert torch.equal(back, torch.full(cache.block_shape(), 2.0))
