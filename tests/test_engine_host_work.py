"""The engine's per-step host work done incrementally gives what doing it from scratch gives: stop strings
found on an output's tail, seeded draws that depend only on (seed, draw), sampling through sorted values only,
block tables kept as rows of host arrays, decodes planned in one go, finish reasons checked in the step loop."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from engine.core.output_text import finish_text, stop_ends, stop_window, stops_hit
from engine.interface import Request, SamplingParams, cut_at_stop
from engine.model.sampler import penalize, sample, seeded_uniforms
from engine.step import StepResult
from tests.engine_helpers import (
    FakeCost,
    greedy,
    kv_block_bytes,
    make_engine,
    prompts,
    run_all,
    sampling_rows,
)

pytestmark = pytest.mark.usefixtures("single_thread")

PIECES = ["Grüße aus ", "東京", " und 終わり", "ST", "OP", " — café ", "naïve ", "🙂 ok", "\n\n", "<|im_end|>", "x"]
STOPS = ["STOP", "終わり", "東京 und", " — c", "🙂", "é n"]


@pytest.fixture(scope="module")
def tokenizer(qwen3_model):
    return AutoTokenizer.from_pretrained(qwen3_model)


def first_hit_from_scratch(tokenizer, ids: list[int], stops: list[str]) -> int | None:
    for n in range(1, len(ids) + 1):
        if cut_at_stop(tokenizer.decode(ids[:n], skip_special_tokens=True), stops)[1]:
            return n
    return None


def may_end_stop(token_text: str, stops: list[str]) -> bool:
    """The rule `stop_ends` serves, stated plainly: a token can complete a stop string when its text brings the
    stop's last character or, where that character is not ASCII, bytes of a character split over tokens
    (U+FFFD alone)."""
    return any(s and (s[-1] in token_text or ("\ufffd" in token_text and not s[-1].isascii())) for s in stops)


def first_hit_on_tails(tokenizer, ids: list[int], stops: list[str]) -> int | None:
    """As the engine does it: only after a token that may end a stop, only the tail decoded."""
    window, ends = stop_window(stops), stop_ends(stops)
    for n in range(1, len(ids) + 1):
        own = tokenizer.decode(ids[n - 1:n], skip_special_tokens=True)
        if not ends.isdisjoint(own) and stops_hit(tokenizer, [(ids[max(0, n - window):n], stops)])[0]:
            return n
    return None


@pytest.mark.parametrize("seed", range(24))
def test_stop_strings_on_the_tail_hit_where_the_whole_text_does(tokenizer, seed):
    rng = random.Random(seed)
    # pieces tokenized apart, so stop strings straddle token boundaries (multi-byte characters split too)
    ids = [t for _ in range(rng.randint(3, 12)) for t in tokenizer.encode(rng.choice(PIECES))]
    stops = rng.sample(STOPS, rng.randint(1, 3))
    assert len(ids) >= 3
    assert first_hit_on_tails(tokenizer, ids, stops) == first_hit_from_scratch(tokenizer, ids, stops)


def test_a_stop_split_over_many_byte_tokens_is_found_in_the_engine(qwen3_model, tokenizer):
    engine = make_engine(qwen3_model)
    ids = [t for piece in ("an ", "ST", "OP", " here") for t in tokenizer.encode(piece)]
    # the model's own tokens do not matter: every request finds its stop in the text it generated
    [done] = run_all(engine, [Request("r", ids[:2], greedy(40))]).values()
    text = tokenizer.decode(done.token_ids, skip_special_tokens=True)
    # three characters from the middle on that are not all blank
    stop = next((text[i:i + 3] for i in range(len(text) // 2, len(text) - 2) if text[i:i + 3].strip()), None)
    assert stop is not None, f"no visible text in the second half of {text!r}"
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, stop=[stop])
    [stopped] = run_all(make_engine(qwen3_model), [Request("s", ids[:2], params)]).values()
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert len(stopped.token_ids) == first_hit_from_scratch(tokenizer, done.token_ids, [stop])


def test_seeded_uniforms_depend_only_on_seed_and_draw():
    seeds, draws = [0, 1, 2**40 + 5, 2**63 - 1, 7], [0, 0, 3, 1 << 33, 9]
    together = seeded_uniforms(seeds, draws, torch.device("cpu"))
    alone = torch.cat([seeded_uniforms([s], [d], torch.device("cpu")) for s, d in zip(seeds, draws, strict=True)])
    assert torch.equal(together, alone) and ((together >= 0) & (together < 1)).all()
    assert len(set(seeded_uniforms([1] * 1000, list(range(1000)), torch.device("cpu")).tolist())) == 1000
    # spread evenly: the mean of many draws of one seed is close to a half
    assert abs(seeded_uniforms([3] * 4000, list(range(4000)), torch.device("cpu")).mean().item() - 0.5) < 0.02


class Row:
    def __init__(self, params: SamplingParams, drawn: int):
        self.params, self.token_ids, self.num_prompt_tokens = params, [1] * (4 + drawn), 4


def test_a_seeded_row_draws_its_next_token_from_its_count_of_draws():
    logits = torch.randn(1, 300)
    p = SamplingParams(8, temperature=1.0, seed=11)
    draws = [sample(logits.clone(), sampling_rows([Row(p, n)]))[0][0] for n in range(40)]
    other = SamplingParams(8, temperature=1.0)
    assert draws == [sample(logits.repeat(2, 1), sampling_rows([Row(p, n), Row(other, n)]))[0][0] for n in range(40)]
    assert len(set(draws)) > 10  # each draw its own number, not one repeated


def test_loop_gap_percentiles_come_back_within_a_bucket():
    from engine.runtime.loop_gaps import PER_DOUBLING, LoopGaps

    gaps = LoopGaps()
    assert gaps.percentile(0.95) == 0.0
    values = [i * 1e-5 for i in range(1, 1001)]  # 10 us .. 10 ms, evenly
    for v in values:
        gaps.observe(v)
    for q in (0.5, 0.95):
        exact = values[int(q * len(values)) - 1]
        assert exact <= gaps.percentile(q) <= exact * 2 ** (1 / PER_DOUBLING) * 1.001
    gaps.observe(1e6)  # far past the last bucket: counted there, memory unchanged
    assert gaps.total == 1001 and len(gaps.counts) == len(LoopGaps().counts)


def test_the_engine_thread_measures_gaps_only_between_back_to_back_steps(tiny_model):
    from engine.runtime.engine_thread import EngineThread

    thread = EngineThread(make_engine(tiny_model))
    try:
        futures = [thread.submit(Request(str(i), [5, 6, 7, 8], greedy(6))) for i in range(3)]
        assert all(f.result(60).finish_reason == "length" for f in futures)
        stats = thread.stats()
    finally:
        thread.close()
    # at least 6 steps ran back to back for 6 tokens; an idle wait for work is no gap
    assert 5 <= stats.loop_gaps < stats.steps and stats.loop_gap_p95_ms > 0


def test_a_steps_inputs_travel_in_one_buffer_and_come_back_as_they_were():
    from engine.model.step_executor import split_copy

    tensors = [torch.tensor([5, 6, 7]), torch.arange(4).view(2, 2), torch.tensor([[1, -1], [2, 3]], dtype=torch.int32),
               torch.empty(0, dtype=torch.int64), torch.tensor([2**40])]
    moved = split_copy(tensors, torch.device("cpu"), pin=False)
    assert all(torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape
               for a, b in zip(tensors, moved, strict=True))


# --- sampling ---------------------------------------------------------------------------------------------------

def sample_from_scratch(logits: torch.Tensor, rows: list[Row]) -> list[int]:
    """Row by row, on the whole vocabulary sorted with its permutation (ties by column): what `sample`
    computes."""
    logits = penalize(logits, sampling_rows(rows))
    tokens = []
    for i, row in enumerate(rows):
        p = row.params
        if p.temperature == 0:
            tokens.append(int(logits[i].argmax()))
            continue
        values, order = (logits[i] / p.temperature).sort(descending=True, stable=True)
        k = p.top_k if p.top_k > 0 else len(values)
        probs = values.masked_fill(torch.arange(len(values)) >= k, float("-inf")).softmax(-1)
        drop = probs.cumsum(-1) - probs >= p.top_p if p.top_p < 1 else torch.zeros_like(probs, dtype=torch.bool)
        drop |= probs < p.min_p * probs[0]
        cdf = probs.masked_fill(drop, 0.0).double().cumsum(-1)
        u = seeded_uniforms([p.seed], [len(row.token_ids) - row.num_prompt_tokens], torch.device("cpu"))
        rank = min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), len(values) - 1)
        tokens.append(int(order[rank]))
    return tokens


# float32 on the CPU goes through numpy, sorted whole or partitioned first (over 512 columns); float64 takes the
# torch path that CUDA tensors take. Rounded logits tie often, as bf16 ones do (topk orders ties as it likes:
# the torch path is checked without them).
@pytest.mark.parametrize("vocab, dtype, step", [(40, torch.float32, 0), (512, torch.float32, 0),
                                                (3000, torch.float32, 0), (512, torch.float64, 0),
                                                (40, torch.float32, 0.5), (3000, torch.float32, 0.25)])
def test_sampling_through_sorted_values_draws_what_the_sorted_permutation_does(vocab, dtype, step):
    rng = random.Random(vocab)
    for _ in range(30):
        rows = [Row(SamplingParams(8, temperature=rng.choice([0.0, 0.7, 1.0, 1.5]),
                                   top_k=rng.choice([0, 1, 7, 50, vocab + 5]), top_p=rng.choice([1.0, 0.95, 0.5]),
                                   min_p=rng.choice([0.0, 0.1]), repetition_penalty=rng.choice([1.0, 1.3]),
                                   seed=rng.randrange(2**63)), rng.randrange(20))
                for _ in range(rng.randint(1, 12))]
        logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(rng.randrange(1000))) * 3
        logits = (logits / step).round() * step if step else logits
        logits = logits.to(dtype)
        assert sample(logits.clone(), sampling_rows(rows))[0] == sample_from_scratch(logits.clone(), rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tied_logits_share_their_mass(dtype):
    logits = torch.full((1, 600), -5.0, dtype=dtype)
    logits[0, [3, 250, 599]] = 2.0  # three tokens tie for the top
    rows = [[Row(SamplingParams(1, temperature=1.0, top_k=3, seed=seed), 0)] for seed in range(300)]
    drawn = [sample(logits.clone(), sampling_rows(row))[0][0] for row in rows]
    counts = Counter(drawn)
    assert set(counts) == {3, 250, 599} and min(counts.values()) > 60, counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_tiny_temperature_samples_as_its_limit_greedy(dtype):
    """The API takes any temperature in OpenAI's 0..2; dividing logits by 1e-40 would overflow them to inf and
    their softmax to NaN."""
    from jobs.schemas import Sampling

    assert Sampling(temperature=1e-40).temperature == 1e-40 and Sampling(temperature=2.0).temperature == 2.0
    logits = torch.randn(6, 600, generator=torch.Generator().manual_seed(5)).to(dtype) * 20
    for temperature in (1e-40, 1e-30, 1e-8, 5e-324):
        rows = [Row(SamplingParams(4, temperature=temperature, top_p=0.9, seed=i), 0) for i in range(6)]
        assert sample(logits.clone(), sampling_rows(rows))[0] == logits.argmax(1).tolist(), temperature


# --- stop strings -----------------------------------------------------------------------------------------------

def test_the_step_loops_stop_check_is_may_end_stop(tokenizer):
    texts = [tokenizer.decode([i], skip_special_tokens=True) for i in range(0, len(tokenizer), 97)]
    texts += [t for piece in PIECES for t in (piece, piece[-1:], "\ufffd")]
    for stops in [[], [""], ["STOP"], ["終わり"], ["é n", "🙂"], STOPS, ["x", ""]]:
        ends = stop_ends(stops)
        assert all((not ends.isdisjoint(text)) == may_end_stop(text, stops) for text in texts), stops


def test_an_ascii_stop_is_not_decoded_for_a_split_character(tokenizer):
    # a lone byte of a multi-byte character decodes to U+FFFD
    text = next(t for t in (tokenizer.decode([i]) for i in range(1000)) if t == "\ufffd")
    assert "\ufffd" in text and not may_end_stop(text, ["STOP"]) and may_end_stop(text, ["終わり"])


def trimmed_from_scratch(tokenizer, ids: list[int], stops: list[str]) -> list[int]:
    """The shortest prefix whose text holds a stop string, every prefix decoded in turn."""
    n = first_hit_from_scratch(tokenizer, ids, stops)
    return ids if n is None else ids[:n]


@pytest.mark.parametrize("seed", range(24))
def test_an_output_is_trimmed_at_its_stop_as_decoding_every_prefix_trims_it(tokenizer, seed):
    rng = random.Random(100 + seed)
    # stops anywhere, as transformers' generate leaves them: a batch's rows run on past their own
    ids = [t for _ in range(rng.randint(3, 40)) for t in tokenizer.encode(rng.choice(PIECES))]
    stops = rng.sample(STOPS, rng.randint(1, 3))
    kept, text, stopped = finish_text(tokenizer, ids, stops, set())
    assert kept == trimmed_from_scratch(tokenizer, ids, stops)
    assert (text, stopped) == cut_at_stop(tokenizer.decode(ids, skip_special_tokens=True), stops)


class CountingTokenizer:
    """A tokenizer that counts the tokens it was asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids: list[int], **kwargs) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("stop_at", [1.0, 0.5, 0.01], ids=["at-the-end", "halfway", "near-the-start"])
def test_trimming_a_long_output_at_its_stop_decodes_it_a_few_times_not_every_prefix(tokenizer, stop_at):
    filler = [t for piece in ("Grüße aus ", "naïve ", "x") for t in tokenizer.encode(piece)]
    body = (filler * 300)[:1500]
    cut = int(len(body) * stop_at)
    ids = body[:cut] + tokenizer.encode("STOP") + body[cut:]
    counting = CountingTokenizer(tokenizer)
    kept, text, stopped = finish_text(counting, ids, ["STOP"], set())
    assert stopped and kept == body[:cut] + tokenizer.encode("STOP") and "STOP" not in text
    # the text, and a probe per halving of the distance back (one for a stop at the end, as the engine ends an
    # output); decoding every prefix up to the stop's would decode over 700,000 tokens for the one at the end
    probes = 1 if stop_at == 1.0 else 2 * len(ids).bit_length()
    assert counting.decoded <= len(ids) * (1 + probes)


# --- block tables kept as host arrays -----------------------------------------------------------------------------

def check_table_rows(engine) -> None:
    """Every sequence holding blocks has its own row, equal to its tables; every other entry is -1."""
    seqs = [*engine.scheduler.running, *engine.scheduler.waiting]
    holding = [s for s in seqs if s.block_tables[0]]
    assert all(s.table_row == -1 for s in seqs if not s.block_tables[0])
    assert len({s.table_row for s in holding}) == len(holding) and all(s.table_row >= 0 for s in holding)
    for p, array in enumerate(engine.blocks.rows.arrays):
        expected = np.full_like(array, -1)
        for s in holding:
            expected[s.table_row, :len(s.block_tables[p])] = s.block_tables[p]
        assert np.array_equal(array, expected)


def packed_from_scratch(engine, step) -> dict[str, list]:
    """A packed step's inputs rebuilt from its sequences' lists, as packing did before the tables were kept."""
    block_size, pools = engine.config.block_size, len(engine.blocks.pools)
    running = {seq.request_id: seq for seq in engine.scheduler.running}
    counts = (step.cu_seqlens[1:] - step.cu_seqlens[:-1]).tolist()
    rows = [(running[request_id], n) for request_id, n in zip(step.request_ids, counts, strict=True)]
    positions = [p for seq, n in rows for p in range(seq.num_computed, seq.num_computed + n)]
    width = max(1, max(len(seq.block_tables[0]) for seq, _ in rows))
    tables = [[seq.block_tables[p] + [-1] * (width - len(seq.block_tables[p])) for seq, _ in rows]
              for p in range(pools)]
    where = [(i, p) for i, (seq, n) in enumerate(rows) for p in range(seq.num_computed, seq.num_computed + n)]
    return {
        # a row longer than its uncomputed tokens carries drafts after them
        "input_ids": [t for seq, n in rows for t in (seq.token_ids[seq.num_computed:] + seq.drafts)[:n]],
        "positions": positions,
        "seq_lens": [seq.num_computed + n for seq, n in rows],
        "cu_seqlens": [sum(counts[:i]) for i in range(len(rows) + 1)],
        "tables": tables,
        "slots": [[t[i][p // block_size] * block_size + p % block_size for i, p in where] for t in tables],
    }


@pytest.mark.parametrize("preset", ["tiny", "tiny-swa"])  # prefix cache and one pool; two pools, rings recycled
def test_table_rows_stay_the_tables_through_preemption_reuse_and_recycling(tiny_models, preset):
    path = tiny_models[preset]
    engine = make_engine(path, kv_cache_memory=48 * kv_block_bytes(path), initial_blocks=4, prefill_chunk_size=64)
    pack, packed = engine.executor.pack, []

    def checked_pack(plan):
        step = pack(plan)
        expected = packed_from_scratch(engine, step)
        assert step.input_ids.tolist() == expected["input_ids"] and step.positions.tolist() == expected["positions"]
        assert step.seq_lens.tolist() == expected["seq_lens"] and step.cu_seqlens.tolist() == expected["cu_seqlens"]
        assert [t.tolist() for t in step.tables] == expected["tables"]
        assert [s.tolist() for s in step.slots] == expected["slots"]
        packed.append(len(step.request_ids))
        return step

    engine.executor.pack = checked_pack
    shared = prompts(1, 64, 64, seed=5)[0]  # a prefix several prompts start with: their blocks are reused
    ids = [shared + tail if i % 2 else tail for i, tail in enumerate(prompts(14, 40, 200, seed=6))]
    requests = [Request(str(i), p, greedy(40)) for i, p in enumerate(ids)]
    done = run_all(engine, requests, check_table_rows)
    assert sorted(done) == sorted(r.request_id for r in requests) and max(packed) > 1
    stats = engine.stats()
    assert stats.preemptions > 0
    assert stats.prefix_cache_hit_tokens > 0 if preset == "tiny" else len(engine.blocks.pools) == 2
    assert all((array == -1).all() for array in engine.blocks.rows.arrays)  # every row given back


# --- decodes planned in one go ------------------------------------------------------------------------------------

def plan_row_by_row(scheduler):
    """The scheduler's plan with every decode going through `_schedule` in its usual order."""
    def run_decodes(decodes, plan):
        for seq in sorted(decodes, key=lambda s: (s.last_step < scheduler._step - 1, s.last_step, s.admitted)):
            scheduler._schedule(seq, 1, plan)
    return run_decodes


@pytest.mark.parametrize("preset", ["tiny", "tiny-swa"])
def test_decodes_planned_in_one_go_are_the_row_by_row_plan(tiny_models, preset):
    path = tiny_models[preset]
    runs = []
    for one_go in (True, False):
        engine = make_engine(path, kv_cache_memory=40 * kv_block_bytes(path), initial_blocks=4, max_num_seqs=12)
        engine.scheduler.cost = FakeCost()
        if not one_go:
            engine.scheduler._schedule_decodes = plan_row_by_row(engine.scheduler)
        schedule, steps = engine.scheduler.schedule, []

        def recorded(now, schedule=schedule, steps=steps):
            plan = schedule(now)
            if plan is not None:
                steps.append(sorted(zip(plan.request_ids, plan.counts.tolist(), strict=True)))
            return plan

        engine.scheduler.schedule = recorded
        requests = [Request(str(i), p, greedy(30)) for i, p in enumerate(prompts(20, 20, 150, seed=3))]
        done = run_all(engine, requests)
        runs.append((steps, {k: c.token_ids for k, c in done.items()}, engine.stats().preemptions))
    assert runs[0] == runs[1] and runs[0][2] > 0


# --- finish reasons -----------------------------------------------------------------------------------------------

def finished_from_scratch(tokenizer, stream: list[int], params: SamplingParams,
                          eos_ids: set[int]) -> tuple[list[int], str]:
    """Token by token, the whole output decoded each time: where a request with `params` ends, and why."""
    for n in range(1, len(stream) + 1):
        eos_hit = stream[n - 1] in eos_ids and not params.ignore_eos
        if eos_hit or cut_at_stop(tokenizer.decode(stream[:n], skip_special_tokens=True), params.stop)[1]:
            reason = "stop"
        elif n >= params.max_new_tokens:
            reason = "length"
        else:
            continue
        eos = set() if params.ignore_eos else eos_ids
        return finish_text(tokenizer, stream[:n], params.stop, eos)[0], reason
    raise AssertionError("the stream ran out")


def test_finish_reasons_from_the_step_loop_are_those_found_from_scratch(qwen3_model, tokenizer):
    # the longest prompt and output fit; the script replaces the one token a row samples
    engine = make_engine(qwen3_model, max_model_len=120, speculative="off")
    eos = sorted(engine.eos_ids)
    rng = random.Random(4)
    streams, requests = {}, []
    for i in range(24):
        # scripted outputs: pieces that straddle tokens, with an EOS now and then
        stream = [t for _ in range(40) for t in (tokenizer.encode(rng.choice(PIECES)) if rng.random() > 0.05
                                                 else [rng.choice(eos)])]
        params = SamplingParams(max_new_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.3,
                                stop=tuple(rng.sample(STOPS, rng.randint(0, 2))))
        prompt = prompts(1, 10, 80, seed=i)[0]
        streams[str(i)] = stream
        requests.append((Request(str(i), prompt, params), stream))
    run = engine.executor.run

    def scripted(plan, masks=None):
        sampled = run(plan, masks).request_ids
        drawn = plan.sampling.drawn.tolist()  # tokens each has generated before this step
        return StepResult(sampled, [streams[r][n] for r, n in zip(sampled, drawn, strict=True)])

    engine.executor.run = scripted
    done = run_all(engine, [r for r, _ in requests])
    for request, stream in requests:
        expected = finished_from_scratch(tokenizer, stream, request.sampling, engine.eos_ids)
        got = done[request.request_id]
        assert (got.token_ids, got.finish_reason) == expected, request.request_id
    assert {c.finish_reason for c in done.values()} == {"stop", "length"}
