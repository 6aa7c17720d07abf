"""End to end through `LLMEngine`: greedy output equals transformers' `generate`, under pressure too; sampling,
stop strings, limits, errors and cancellation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine.interface import Request, RequestError, SamplingParams, fits
from engine.model.cuda_graphs import PieceGraphs
from engine.runtime.engine_thread import EngineThread
from jobs.chat import chat_problem
from tests.engine_helpers import (
    FakeCost,
    greedy,
    json_grammar,
    kv_block_bytes,
    make_engine,
    prompts,
    run_all,
    transformers_greedy,
)

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = prompts(24, 5, 400, seed=3)
NEW_TOKENS = [4 + i % 13 for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def hf_outputs(tiny_models) -> dict[str, list[list[int]]]:
    return {preset: transformers_greedy(tiny_models[preset], PROMPTS, NEW_TOKENS)
            for preset in ("tiny", "tiny-untied", "tiny-swa")}


@pytest.mark.parametrize("preset", ["tiny", "tiny-untied", "tiny-swa"])
@pytest.mark.parametrize("pressure", [False, True], ids=["roomy", "preempting"])
def test_greedy_matches_transformers(tiny_models, hf_outputs, preset, pressure):
    path = tiny_models[preset]
    if pressure:
        # 48 blocks of 16 tokens for ~5k tokens of work, 64-token prefill chunks, 96 tokens a step
        engine = make_engine(path, kv_cache_memory=48 * kv_block_bytes(path), initial_blocks=8,
                             max_num_batched_tokens=96, prefill_chunk_size=64, max_num_seqs=32)
    else:
        engine = make_engine(path)
    requests = [Request(str(i), ids, greedy(n, ignore_eos=False))
                for i, (ids, n) in enumerate(zip(PROMPTS, NEW_TOKENS, strict=True))]
    done = run_all(engine, requests)
    assert [done[str(i)].token_ids for i in range(len(PROMPTS))] == hf_outputs[preset]
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.running == stats.waiting == 0
    if pressure:
        assert stats.preemptions > 0
        assert sum(c.timings.preemptions for c in done.values()) == stats.preemptions
        assert stats.kv_blocks_total <= stats.kv_blocks_max


@pytest.mark.parametrize("pressure", [False, True], ids=["roomy", "preempting"])
def test_greedy_matches_transformers_beside_constrained_requests(tiny_models, hf_outputs, pressure):
    """Every prompt twice: free (transformers' tokens) and under a JSON schema (a valid record), in shared steps."""
    path = tiny_models["tiny"]
    engine = (make_engine(path, kv_cache_memory=64 * kv_block_bytes(path), initial_blocks=8, max_num_batched_tokens=96,
                          prefill_chunk_size=64, max_num_seqs=32) if pressure else make_engine(path))
    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
              "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 999}}}
    grammar = json_grammar(schema)
    requests = []
    for i, (ids, n) in enumerate(zip(PROMPTS, NEW_TOKENS, strict=True)):
        requests.append(Request(str(i), ids, greedy(n, ignore_eos=False)))
        requests.append(Request(f"json{i}", ids, SamplingParams(max_new_tokens=40, grammar=grammar)))
    done = run_all(engine, requests)
    assert [done[str(i)].token_ids for i in range(len(PROMPTS))] == hf_outputs["tiny"]
    for i in range(len(PROMPTS)):
        record = json.loads(done[f"json{i}"].text)
        assert set(record) == {"ok", "n"} and 0 <= record["n"] <= 999
    assert engine.stats().preemptions > 0 or not pressure


def test_greedy_matches_transformers_while_latency_targets_cut_bulk_work(tiny_models, hf_outputs):
    """Every third request interactive; a step-cost model under which every step carrying them has room for only
    part of the bulk work: bulk rows are left out of steps and prefill chunks are cut, the tokens stay the same."""
    engine = make_engine(tiny_models["tiny"], max_num_seqs=32)
    engine.scheduler.cost = FakeCost()
    requests = [Request(str(i), ids, greedy(n, ignore_eos=False), priority=9 if i % 3 == 0 else 1,
                        interactive=i % 3 == 0)
                for i, (ids, n) in enumerate(zip(PROMPTS, NEW_TOKENS, strict=True))]
    done = run_all(engine, requests)
    assert [done[str(i)].token_ids for i in range(len(PROMPTS))] == hf_outputs["tiny"]
    stats = engine.stats()
    assert stats.bulk_rows_deferred > 0 and stats.limited_steps > 0


@pytest.mark.parametrize("preset", ["tiny", "tiny-swa"])
def test_greedy_matches_transformers_through_the_graph_pieces(tiny_models, hf_outputs, preset):
    """Every step as `PieceGraphs` runs it on a GPU, here as plain calls instead of replays: the token count
    padded up to a bucket, each piece between two attentions on the static buffers. Steps of at most 96 tokens
    under pre-emption: prefill chunks, mixed steps and decodes (a windowed model's too) all go through them."""
    path = tiny_models[preset]
    engine = make_engine(path, kv_cache_memory=48 * kv_block_bytes(path), initial_blocks=8,
                         max_num_batched_tokens=96, prefill_chunk_size=64, max_num_seqs=32)
    pieces = engine.executor.pieces = PieceGraphs(engine.model, 96)
    pieces.capture()
    assert pieces.sizes == [8, 16, 32, 48, 64, 80, 96] and list(pieces.graphs) == pieces.sizes[::-1]
    requests = [Request(str(i), ids, greedy(n, ignore_eos=False))
                for i, (ids, n) in enumerate(zip(PROMPTS, NEW_TOKENS, strict=True))]
    done = run_all(engine, requests)
    assert [done[str(i)].token_ids for i in range(len(PROMPTS))] == hf_outputs[preset]
    stats = engine.stats()
    assert pieces.steps == stats.steps and stats.preemptions > 0


def test_dense_decode_rows_follow_preemption(tiny_models, hf_outputs):
    path = tiny_models["tiny"]
    engine = make_engine(path, kv_cache_memory=48 * kv_block_bytes(path), initial_blocks=8,
                         max_num_batched_tokens=96, prefill_chunk_size=64, max_num_seqs=32)
    engine.executor.dense.max_bytes = 1 << 30  # every decode through dense rows, however small the pool
    requests = [Request(str(i), ids, greedy(n, ignore_eos=False))
                for i, (ids, n) in enumerate(zip(PROMPTS, NEW_TOKENS, strict=True))]
    done = run_all(engine, requests)
    assert [done[str(i)].token_ids for i in range(len(PROMPTS))] == hf_outputs["tiny"]
    assert engine.stats().preemptions > 0 and engine.memory_report()["dense_decode_bytes"] > 0


def test_timings_are_filled(tiny_model):
    engine = make_engine(tiny_model)
    done = run_all(engine, [Request(str(i), ids, greedy(8)) for i, ids in enumerate(prompts(4, 10, 50))])
    for c in done.values():
        t = c.timings
        assert 0 <= t.queue_wait_ms <= t.ttft_ms
        assert t.prefill_ms > 0 and t.decode_ms > 0
        assert t.batch_size == 4 and t.preemptions == 0 and t.prompt_tokens_reused == 0


def test_seeded_sampling_is_reproducible(tiny_model):
    def sampled(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=seed, ignore_eos=True)

    engine = make_engine(tiny_model)
    prompt = prompts(1, 30, 30, seed=5)[0]
    # the same seed in different batch company, and in a later run, gives the same tokens
    first = run_all(engine, [Request("a", prompt, sampled(7)), Request("b", prompt, sampled(7)),
                             Request("c", prompt, sampled(8))])
    again = run_all(engine, [Request("a", prompt, sampled(7))] + [Request(f"x{i}", p, greedy(5))
                                                                   for i, p in enumerate(prompts(5, 5, 40))])
    assert first["a"].token_ids == first["b"].token_ids == again["a"].token_ids
    assert first["a"].token_ids != first["c"].token_ids
    greedy_ids = run_all(engine, [Request("g", prompt, greedy(24))])["g"].token_ids
    assert first["a"].token_ids != greedy_ids


def test_stop_strings_and_length(tiny_model):
    engine = make_engine(tiny_model)
    prompt = prompts(1, 20, 20, seed=6)[0]
    full = run_all(engine, [Request("full", prompt, greedy(40))])["full"]
    assert full.finish_reason == "length" and len(full.token_ids) == 40
    stop = full.text[len(full.text) // 2:][:3]
    stopped = run_all(engine, [Request("s", prompt, SamplingParams(max_new_tokens=40, stop=(stop,), ignore_eos=True))])["s"]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.find(stop)]
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)] and len(stopped.token_ids) < 40


def test_eos_ends_a_request_unless_ignored(tiny_model):
    engine = make_engine(tiny_model)
    prompt = prompts(1, 20, 20, seed=6)[0]
    first = run_all(engine, [Request("a", prompt, greedy(1))])["a"].token_ids[0]
    engine.eos_ids = {first}  # pretend the model's first answer is its end-of-sequence token
    assert run_all(engine, [Request("b", prompt, greedy(5, ignore_eos=False))])["b"].finish_reason == "stop"
    kept = run_all(engine, [Request("c", prompt, greedy(5, ignore_eos=True))])["c"]
    assert kept.finish_reason == "length" and kept.token_ids[0] == first and len(kept.token_ids) == 5


def test_requests_that_can_never_run(tiny_model):
    engine = make_engine(tiny_model)
    with pytest.raises(RequestError, match="context"):
        engine.add_request(Request("long", [5] * engine.max_model_len, greedy(1)))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request(Request("empty", [], greedy(1)))
    # the prompt and all of the output it may ask for must fit, not the prompt alone
    edge = engine.max_model_len - 8
    with pytest.raises(RequestError, match="with max_new_tokens 9 it exceeds the model's context"):
        engine.add_request(Request("over", [5] * edge, greedy(9)))
    engine.add_request(Request("edge", [5] * edge, greedy(8)))
    engine.abort_request("edge")
    small = make_engine(tiny_model, kv_cache_memory=8 * kv_block_bytes(tiny_model))
    with pytest.raises(RequestError, match="KV blocks"):
        small.add_request(Request("big", [5] * 200, greedy(10)))
    # through the engine thread the failure is that request's completion, and the engine keeps serving
    runner = EngineThread(engine)
    try:
        failed = runner.submit(Request("long", [5] * 2000, greedy(1))).result(60)
        ok = runner.submit(Request("ok", [5] * 10, greedy(3))).result(60)
    finally:
        runner.close()
    assert failed.finish_reason == "error" and "context" in failed.error
    assert ok.finish_reason == "length" and len(ok.token_ids) == 3


def test_the_engine_and_the_contract_agree_on_what_fits():
    """The API refuses what `jobs.chat.chat_problem` refuses; the engine must refuse exactly that too."""
    cases = [(prompt, max_new, context) for context in (1, 64, 40960) for prompt in (1, context // 2, context - 1,
             context, context + 1) for max_new in (1, context - prompt - 1, context - prompt, context - prompt + 1)
             if prompt >= 1 and max_new >= 1]
    assert len(cases) > 30
    assert [c for c in cases if fits(*c) != (chat_problem(*c) is None)] == []
    assert fits(60, 4, 64) and not fits(60, 5, 64)


def test_cancel(tiny_model):
    engine = make_engine(tiny_model)
    for i, ids in enumerate(prompts(4, 20, 40)):
        engine.add_request(Request(str(i), ids, greedy(50)))
    engine.add_request(Request("queued", [5] * 10, greedy(50)))
    for _ in range(3):
        engine.step()
    used = engine.stats().kv_blocks_used
    cancelled = engine.abort_request("1")
    assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) == 3
    assert engine.stats().kv_blocks_used < used  # its blocks came back at once
    assert engine.abort_request("1") is None and engine.abort_request("unknown") is None
    done = run_all(engine, [])
    assert sorted(done) == ["0", "2", "3", "queued"]
    assert all(len(c.token_ids) == 50 for c in done.values())


def test_bfloat16_on_cpu(tiny_model):
    engine = make_engine(tiny_model, dtype="bfloat16")
    assert engine.model.lm_head.weight.dtype == torch.bfloat16
    done = run_all(engine, [Request(str(i), ids, greedy(6)) for i, ids in enumerate(prompts(3, 5, 80))])
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in done.values())


def test_dense_rows_grow_geometrically_up_to_the_context():
    from engine.core.kv_cache import KVCache
    from engine.model.dense_decode import DenseDecodeKV

    cache = KVCache(2, 4, 16, 2, 8, torch.float32, torch.device("cpu"))
    per_token = 2 * 2 * 2 * 8 * 4
    dense = DenseDecodeKV(cache, 0, max_bytes=64 * 300 * per_token, max_length=300, max_rows=64)
    # rows for every sequence of the step, the length they will reach (aligned)
    assert dense._fit(3, 10, final_rows=4, final_length=40) and dense.data.shape[2:4] == (4, 64)
    assert dense._fit(4, 20, final_rows=4, final_length=40) and dense.data.shape[2:4] == (4, 64)  # no growth
    assert dense._fit(5, 70, final_rows=5, final_length=90) and dense.data.shape[2:4] == (6, 128)  # 1.5x both
    assert dense._fit(6, 200, final_rows=6, final_length=280) and dense.data.shape[2:4] == (6, 300)  # context cap
    assert dense._fit(64, 300, final_rows=64, final_length=300) and dense.data.shape[2:4] == (64, 300)  # all fits
    assert not dense._fit(65, 300, final_rows=65, final_length=300)  # over the budget: the step runs paged
    # 1.5x more rows would not fit the budget: as many as fit, not just the one more this step needs
    tight = DenseDecodeKV(cache, 0, max_bytes=40 * 300 * per_token, max_length=300, max_rows=256)
    assert tight._fit(30, 300, final_rows=30, final_length=300) and tight.data.shape[2:4] == (30, 300)
    assert tight._fit(31, 300, final_rows=31, final_length=300) and tight.data.shape[2:4] == (40, 300)
    # never more rows than a step can decode, so the budget stays for the length
    capped = DenseDecodeKV(cache, 0, max_bytes=64 * 300 * per_token, max_length=300, max_rows=8)
    assert capped._fit(6, 100, final_rows=6, final_length=100) and capped._fit(7, 100, final_rows=7, final_length=100)
    assert capped.data.shape[2] == 8


def test_a_dense_row_that_fell_behind_copies_only_the_tokens_it_missed():
    """A sequence whose K/V moved on without its dense row (a step that ran paged) has
    its row caught up with the tokens it missed when it decodes again: copying its whole context anew at every
    verify step cost bulk steps more than its drafts saved."""
    from engine.core.kv_cache import KVCache
    from engine.model.dense_decode import DenseDecodeKV
    from engine.step import StepPlan

    cache = KVCache(2, 8, 16, 2, 8, torch.float32, torch.device("cpu"))
    for segment in cache.segments:
        segment.copy_(torch.randn_like(segment))
    dense = DenseDecodeKV(cache, 0, max_bytes=1 << 20, max_length=128, max_rows=4)
    tables = np.array([[0, 1, 2], [3, 4, -1]], np.int32)

    def decode(starts: list[int]) -> StepPlan:
        return StepPlan(["a", "b"], 2, np.array(starts), np.ones(2, np.int64), np.full(2, 128), np.zeros(2, np.int64),
                        [tables], np.arange(2), ["a", "b"], None, [])

    dense.sync(decode([20, 10]), np.arange(2))
    first = dense.data[:, :, dense.order.index("a"), :20].clone()
    # "a" runs 4 tokens in a paged step and keeps them all; its row is not written, and
    # what its row already holds is overwritten in the pool, so a copy of the whole context would show
    for kv in range(2):
        for layer in range(2):
            cache.layer(layer)[kv][0, :] = 1e6
    dense.sync(decode([25, 11]), np.arange(2))
    row = dense.order.index("a")
    assert dense.filled["a"] == 26
    torch.testing.assert_close(dense.data[:, :, row, :20], first)
    for kv in range(2):
        for layer in range(2):
            torch.testing.assert_close(dense.data[kv, layer, row, 21:25], cache.layer(layer)[kv][1, 5:9])


def test_rows_verifying_drafts_attend_through_dense_rows_as_the_pool_does():
    """A row verifying drafts writes its token and drafts into its dense row and attends to it, each query up
    to its own position, beside plain decodes: the output is paged attention's over the pool. When its drafts
    were rejected the row keeps the tokens that stood (it is not copied again) and the next step writes over
    the rest."""
    from engine.core.kv_cache import KVCache
    from engine.model.dense_decode import DenseDecodeKV
    from engine.step import StepPlan
    from kernels.attention_ref import paged_attention_ref, store_kv_ref

    torch.manual_seed(0)
    cache = KVCache(1, 8, 16, 2, 8, torch.float32, torch.device("cpu"))
    for segment in cache.segments:
        segment.copy_(torch.randn_like(segment))
    dense = DenseDecodeKV(cache, 0, max_bytes=1 << 20, max_length=128, max_rows=4)
    tables = np.array([[0, 1, 2], [3, 4, 5], [6, 7, -1]], np.int32)

    def step(starts: list[int], counts: list[int], decodes: int) -> None:
        plan = StepPlan(["a", "b", "c"], decodes, np.array(starts), np.array(counts), np.full(3, 128),
                        np.zeros(sum(counts), np.int64), [tables], np.arange(3), ["a", "b", "c"], None, [],
                        np.array(counts) - 1)
        order = dense.sync(plan, np.arange(3))
        counts_o = np.array(counts)[order]
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(counts_o)]))
        seq_lens = torch.from_numpy((np.array(starts) + np.array(counts))[order])
        table = torch.from_numpy(tables[order])
        q, k, v = (torch.randn(int(cu[-1]), heads, 8) for heads in (4, 2, 2))
        rows, positions = dense.rows.numpy(), dense.positions.numpy()
        slots = torch.from_numpy(table.numpy()[rows, positions // 16].astype(np.int64) * 16 + positions % 16)
        k_cache, v_cache = cache.layer(0)
        store_kv_ref(k, v, k_cache, v_cache, slots)
        torch.testing.assert_close(dense.attend(0, q, k, v, 0.3),
                                   paged_attention_ref(q, k_cache, v_cache, cu, seq_lens, table, 0.3))

    step([20, 30, 9], [1, 4, 1], decodes=1)  # "a" and "c" decode, "b" verifies 3 drafts
    assert dense.filled == {"a": 21, "b": 34, "c": 10}
    # "b" kept its token and one draft (32 tokens stand); "a" verifies 2 drafts, "c" decodes
    copied = []
    fill, catch_up = dense._fill, dense._catch_up
    dense._fill = lambda plan, new: copied.extend(plan.request_ids[i] for i in new) or fill(plan, new)
    dense._catch_up = lambda plan, behind: copied.extend(r for r, _ in behind) or catch_up(plan, behind)
    step([21, 32, 10], [3, 1, 1], decodes=1)
    assert dense.filled == {"a": 24, "b": 33, "c": 11} and copied == []
    step([24, 33, 11], [2, 3, 2], decodes=0)  # every row verifies drafts
    assert dense.filled == {"a": 26, "b": 36, "c": 13} and copied == []
