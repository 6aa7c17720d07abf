"""Speculative decoding through the real engine: the output with drafts is the output without them, token for
token (greedy and seeded sampling), through chunked prefill, pre-emption, prefix reuse, grammars, stop strings,
length limits, log-probabilities, choices, reasoning budgets, cancels and tensor-parallel ranks; rejected drafts
leave no block behind and never reach the prefix cache; sampling with drafts draws from the model's distribution;
grammar-forced drafts stand; drafts go where the step cost says they pay."""

from __future__ import annotations

import json
import math
import statistics
from datetime import UTC, datetime

import numpy as np
import pytest
import torch

from engine.core.draft_record import Record
from engine.interface import Request, SamplingParams
from engine.runtime.engine_thread import EngineThread
from jobs.schemas import JobIn
from jobs.settings import Settings
from tests.engine_helpers import FakeCost, greedy, json_grammar, kv_block_bytes, make_engine, prompts, run_all
from tests.test_engine_host_work import check_table_rows
from worker.bridge import Bridge
from worker.reply import reply

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = prompts(16, 5, 300, seed=8)
NEW_TOKENS = [6 + 3 * i for i in range(len(PROMPTS))]
TIGHT = dict(initial_blocks=8, max_num_batched_tokens=96, prefill_chunk_size=64, max_num_seqs=32)


class Oracle:
    """Stands in for a sequence's n-gram index: proposes what the sequence's reference output (the same request
    without drafts) holds next, some drafts changed, so that rows see accepted runs, rejections at every
    position, and bonus tokens."""

    def __init__(self, prompt_tokens: int, reference: list[int], wrong: int) -> None:
        self.prompt_tokens, self.reference, self.wrong = prompt_tokens, reference, wrong

    def update(self, tokens: list[int]) -> None:
        pass

    def propose(self, tokens: list[int], extra: list[int], k: int) -> list[int]:
        at = len(tokens) + len(extra) - self.prompt_tokens
        ahead = self.reference[at:at + k]
        return [t if (at + i + 1) * 7919 % self.wrong else t + 1 for i, t in enumerate(ahead)]


def run(engine, requests: list[Request], reference: dict | None = None, wrong: int = 5, check=None,
        trusted: bool = True) -> dict:
    """Each request to its end; with `reference` (request id -> its tokens without drafts) the drafts come from
    an `Oracle` (`trusted`: the drafter counts on them being accepted), else from the sequences' own n-grams.
    `check(engine)` runs after every step."""
    for request in requests:
        engine.add_request(request)
        seq = engine._seqs[request.request_id]
        if reference is not None and seq.ngram is not None:
            oracle(seq, reference[request.request_id], wrong, trusted)
    return run_all(engine, [], check)


def oracle(seq, reference: list[int], wrong: int, trusted: bool = True) -> None:
    """`seq`'s n-gram drafts from an `Oracle`; `trusted`: its record says they are accepted 95 times in 100, so
    that every one it offers is worth proposing."""
    seq.ngram = Oracle(seq.num_prompt_tokens, reference, wrong)
    if trusted:
        seq.copied_record = Record(95.0, 100.0)


def outcome(done: dict) -> dict:
    return {k: (c.token_ids, c.text, c.finish_reason) for k, c in sorted(done.items())}


def check_blocks(engine) -> None:
    """After a step: no sequence holds a block past its tokens (rejected drafts gave theirs back), every block a
    sequence shares with the prefix cache is one it computed and holds its own tokens, and the tables agree."""
    block_size, prefix = engine.config.block_size, engine.blocks.prefix
    for seq in engine.scheduler.running:
        assert len(seq.block_tables[0]) <= -(-seq.num_tokens // block_size)
        assert seq.num_computed < seq.num_tokens
        for i, block in enumerate(seq.block_tables[0]):
            if prefix is not None and prefix.holds(block):
                assert (i + 1) * block_size <= seq.num_computed
                assert prefix.entries[block].tokens == tuple(seq.token_ids[i * block_size:(i + 1) * block_size])
    check_table_rows(engine)


def greedy_requests(**sampling) -> list[Request]:
    return [Request(str(i), ids, SamplingParams(max_new_tokens=n, **sampling))
            for i, (ids, n) in enumerate(zip(PROMPTS, NEW_TOKENS, strict=True))]


@pytest.mark.parametrize("preset", ["tiny", "tiny-swa"])  # one pool and a prefix cache; rings of blocks too
@pytest.mark.parametrize("pressure", [False, True], ids=["roomy", "preempting"])
def test_greedy_output_with_drafts_is_the_output_without(tiny_models, preset, pressure):
    path = tiny_models[preset]
    tight = dict(kv_cache_memory=48 * kv_block_bytes(path), **TIGHT) if pressure else {}
    plain = run(make_engine(path, speculative="off", **tight), greedy_requests())
    engine = make_engine(path, **tight)
    dense_verify_steps = []

    def check(engine) -> None:
        check_blocks(engine)
        dense = engine.executor.dense
        dense_verify_steps.append(dense is not None and bool(dense.drafts))

    drafted = run(engine, greedy_requests(), {k: c.token_ids for k, c in plain.items()}, check=check)
    assert outcome(drafted) == outcome(plain)
    if preset == "tiny":  # one full-attention pool on CPU: rows verifying drafts read dense rows as decodes do
        assert any(dense_verify_steps)
    stats = engine.stats()
    assert 0 < stats.draft_tokens_accepted < stats.draft_tokens and stats.draft_rows > 0
    assert stats.draft_accepted_length == stats.draft_tokens_accepted / stats.draft_rows
    assert stats.kv_blocks_used == 0 and stats.running == stats.waiting == 0
    assert stats.steps < sum(NEW_TOKENS)  # rows yielded several tokens a step
    if pressure:
        assert stats.preemptions > 0


def test_drafts_verify_the_same_whether_a_step_reads_dense_rows_or_runs_paged(tiny_model):
    """A dense-row budget too small for the step's rows while many decode: steps with drafts run paged (the
    rows verifying drafts as extends), then, once enough rows have finished, read dense rows copied from the
    pool, whose drafts' K/V the paged steps wrote; the output is the output without drafts throughout."""
    plain = run(make_engine(tiny_model, speculative="off"), greedy_requests())
    engine = make_engine(tiny_model)
    dense = engine.executor.dense
    dense.max_bytes = 6 * 320 * dense.bytes_per_token  # six rows of 320 tokens
    synced, sync = [], dense.sync
    dense.sync = lambda plan, rows: synced.append((plan.drafts is not None, out := sync(plan, rows))) or out
    drafted = run(engine, greedy_requests(), {k: c.token_ids for k, c in plain.items()}, check=check_blocks)
    assert outcome(drafted) == outcome(plain)
    with_drafts = [out is not None for has_drafts, out in synced if has_drafts]
    assert False in with_drafts and True in with_drafts[with_drafts.index(False):]  # paged, then dense


def test_rejected_drafts_never_reach_the_prefix_cache_and_cached_prefixes_serve_the_same_tokens(tiny_model):
    """Every draft wrong half the time, rows long enough to fill blocks with them; then the same prompts again,
    served from the cache the first run left (without drafts, so the blocks alone decide the tokens)."""
    shared = prompts(1, 48, 48, seed=2)[0]
    requests = [Request(str(i), shared + tail, greedy(40)) for i, tail in enumerate(prompts(6, 3, 40, seed=3))]
    plain = run(make_engine(tiny_model, speculative="off"), requests)
    engine = make_engine(tiny_model, speculative_tokens=16)
    drafted = run(engine, requests, {k: c.token_ids for k, c in plain.items()}, wrong=2, check=check_blocks)
    assert outcome(drafted) == outcome(plain)
    assert engine.stats().draft_tokens - engine.stats().draft_tokens_accepted > 16  # rejected drafts filled blocks
    truth = [tuple(r.prompt_ids + plain[r.request_id].token_ids) for r in requests]
    for block, entry in engine.blocks.prefix.entries.items():  # each cached block holds a run of true tokens
        assert any(entry.tokens == tokens[i:i + 16] for tokens in truth for i in range(0, len(tokens), 16)), block
    without_drafts = SamplingParams(max_new_tokens=10, ignore_eos=True, speculative="off")
    again = run(engine, [Request(f"again{r.request_id}", r.prompt_ids + plain[r.request_id].token_ids[:30],
                                 without_drafts) for r in requests])
    assert engine.stats().prefix_cache_hit_tokens > 0
    for r in requests:
        assert again[f"again{r.request_id}"].token_ids == plain[r.request_id].token_ids[30:40]


def test_stops_lengths_eos_and_logprobs_are_the_same_with_drafts(tiny_model):
    """Stop strings taken from the outputs themselves (so that they end them part way), every length, EOS
    honoured, and the log-probabilities of every token."""
    free = run(make_engine(tiny_model, speculative="off"), greedy_requests(ignore_eos=True))
    stops = {k: (c.text[len(c.text) // 2:len(c.text) // 2 + 3],) for k, c in free.items() if len(c.text) > 8}

    def requests() -> list[Request]:
        return [Request(str(i), ids, SamplingParams(max_new_tokens=n, stop=stops.get(str(i), ()), logprobs=3))
                for i, (ids, n) in enumerate(zip(PROMPTS, NEW_TOKENS, strict=True))]

    plain = run(make_engine(tiny_model, speculative="off"), requests())
    engine = make_engine(tiny_model)
    drafted = run(engine, requests(), {k: c.token_ids for k, c in free.items()}, wrong=4)
    assert outcome(drafted) == outcome(plain)
    assert sum(c.finish_reason == "stop" for c in plain.values()) >= 4  # the stops cut outputs short
    for k, c in plain.items():
        assert len(drafted[k].logprobs) == len(c.logprobs) == len(c.token_ids)
        for (lp, top), (want, want_top) in zip(drafted[k].logprobs, c.logprobs, strict=True):
            assert lp == pytest.approx(want, abs=1e-4) and [t for t, _ in top] == [t for t, _ in want_top]
    assert engine.stats().draft_tokens_accepted > 0


def sampled_requests(prompt: list[int], seeds: range) -> list[Request]:
    params = dict(temperature=0.9, top_p=0.95, top_k=40, min_p=0.01, repetition_penalty=1.2, presence_penalty=0.3)
    return [Request(f"s{seed}", prompt, SamplingParams(max_new_tokens=48, seed=seed, ignore_eos=True, **params))
            for seed in seeds]


def test_seeded_sampling_gives_the_same_tokens_with_drafts(tiny_model):
    """Penalties, temperature and every filter, several seeds of one prompt (a job's choices): each position of a
    row with drafts draws with its own counter and history, so the tokens are those drawn one at a time."""
    prompt = prompts(1, 40, 40, seed=5)[0]
    plain = run(make_engine(tiny_model, speculative="off"), sampled_requests(prompt, range(6)))
    assert len({tuple(c.token_ids) for c in plain.values()}) == 6
    engine = make_engine(tiny_model)
    drafted = run(engine, sampled_requests(prompt, range(6)), {k: c.token_ids for k, c in plain.items()}, wrong=6)
    assert outcome(drafted) == outcome(plain)
    assert engine.stats().draft_tokens_accepted > 0


def test_choices_of_a_job_are_the_same_whether_it_speculates_or_not(tiny_model):
    """A job's `sampling.speculative` reaches its requests: `off` leaves them no index to draft from; with
    drafts (from the `off` job's own answers) the seeded choices are the same."""
    engine = make_engine(tiny_model, speculative="off")
    prepare, answers = engine.prepare, {}

    def drafting(request):
        seq = prepare(request)
        choice = request.request_id.partition(":")[2] or "0"
        if seq.ngram is not None:
            seq.ngram = Oracle(seq.num_prompt_tokens, answers[choice], wrong=5)
        else:
            answers[choice] = None
        return seq

    engine.prepare = drafting
    bridge = Bridge(EngineThread(engine), Settings())

    def answer(job_id: str, speculative: str) -> list[list[int]]:
        job = JobIn(messages=[{"role": "user", "content": "Where is my parcel? It was due on Monday."}], n=3,
                    sampling={"max_new_tokens": 32, "temperature": 1.0, "seed": 11, "speculative": speculative})
        with bridge.run(job_id, job, datetime.now(UTC)) as running:
            result = reply(running)
        return [c.completion.token_ids for c in [result, *result.choices]]

    try:
        without = answer("job-a", "off")
        assert set(answers) == {"0", "1", "2"} and len({tuple(t) for t in without}) == 3
        answers.update({str(i): tokens for i, tokens in enumerate(without)})
        assert answer("job-b", "ngram") == without
        assert bridge.stats().draft_tokens_accepted > 0
    finally:
        bridge.close()


def test_a_cancel_between_steps_keeps_the_tokens_that_stood(tiny_model):
    plain = run(make_engine(tiny_model, speculative="off"), greedy_requests())
    reference = {k: c.token_ids for k, c in plain.items()}
    engine = make_engine(tiny_model)
    requests = greedy_requests()
    for request in requests:
        engine.add_request(request)
        oracle(engine._seqs[request.request_id], reference[request.request_id], wrong=3)
    done = {}
    for _ in range(6):
        done.update((c.request_id, c) for c in engine.step())
    drafted_before = engine.stats().draft_tokens
    cancelled = engine.abort_request("15")
    assert drafted_before > 0 and cancelled.finish_reason == "cancelled"
    assert 0 < len(cancelled.token_ids) < NEW_TOKENS[15]
    assert cancelled.token_ids == reference["15"][:len(cancelled.token_ids)]
    done.update(run_all(engine, []))
    assert {k: c.token_ids for k, c in done.items()} == {k: v for k, v in reference.items() if k != "15"}
    assert engine.stats().kv_blocks_used == 0


RECORD = {"type": "object", "additionalProperties": False,
          "required": ["customer_sentiment_after_the_call", "category", "resolved"],
          "properties": {"customer_sentiment_after_the_call": {"enum": ["positive", "neutral", "negative"]},
                         "category": {"enum": ["delivery_problem", "billing_problem", "account_problem"]},
                         "resolved": {"type": "boolean"}}}


def test_grammar_forced_drafts_stand_and_constrained_outputs_are_the_same(tiny_model):
    """Records under a schema with long keys and enum values: the text the grammar forces is drafted, with the
    sequences' own n-grams after it; each draft counted certain is the one token the grammar allows there (so it
    is always accepted), and most forced drafts are."""
    grammar = json_grammar(RECORD)

    def requests() -> list[Request]:
        return [Request(str(i), ids, SamplingParams(max_new_tokens=160, grammar=grammar))
                for i, ids in enumerate(prompts(6, 10, 60, seed=4))]

    plain = run(make_engine(tiny_model, speculative="off"), requests())
    engine = make_engine(tiny_model)
    forced, propose = [], engine.scheduler.drafter.propose

    def recorded(seq, cap, value):
        drafts = propose(seq, cap, value)
        forced.append((seq.request_id, len(seq.output_ids), drafts[:seq.certain + seq.forced], seq.certain))
        return drafts

    engine.scheduler.drafter.propose = recorded
    drafted = run(engine, requests(), check=check_blocks)
    assert outcome(drafted) == outcome(plain)
    assert all(json.loads(c.text)["resolved"] in (True, False) for c in drafted.values())
    stats = engine.stats()
    assert stats.draft_tokens_accepted > 20 and stats.steps < sum(len(c.token_ids) for c in plain.values()) / 2
    bitmask = torch.empty((1, engine.grammars.words), dtype=torch.int32)
    certain = stood = drafts = 0
    for request_id, at, tokens, sure in forced:
        output = drafted[request_id].token_ids
        matcher = engine.grammars.matcher(grammar)
        for token in output[:at]:
            assert matcher.accept_token(token)
        for j, (token, written) in enumerate(zip(tokens, output[at:], strict=False)):
            matcher.fill_next_token_bitmask(bitmask)
            allowed = int(np.bitwise_count(bitmask.numpy().view(np.uint32)).sum())
            if j < sure:  # the grammar allows it alone: the model wrote it
                certain += 1
                assert allowed == 1 and written == token
            drafts, stood = drafts + 1, stood + (written == token)
            if written != token:
                break
            assert matcher.accept_token(token)
    assert certain > 20 and stood > 0.6 * drafts


def tokens_before(plan) -> list[int]:
    """The token at each sample position of `plan` (what the logits there follow): a row's last 1 + drafts."""
    ends, tokens = np.cumsum(plan.counts).tolist(), plan.input_ids.tolist()
    before = []
    for row in plan.sample_rows.tolist():
        k = int(plan.drafts[row]) if plan.drafts is not None else 0
        before += tokens[ends[row] - k - 1:ends[row]]
    return before


def scripted_logits(engine, script) -> None:
    """The engine's forward runs, and the token `script(token before, tokens drawn so far)` is then made the
    certain choice at every sample position: a model that writes the script, drafts or not."""
    logits = engine.executor.logits

    def scripted(plan):
        out = logits(plan)
        if out is not None:
            for i, (token, drawn) in enumerate(zip(tokens_before(plan), plan.sampling.drawn.tolist(), strict=True)):
                out[i, script(token, drawn)] += 1e4
        return out

    engine.executor.logits = scripted


def test_a_model_that_copies_its_prompt_has_its_ngram_drafts_accepted(tiny_model):
    """A model scripted to copy spans of its prompt: its own n-grams predict it, so most drafts stand and each
    row yields several tokens a step."""
    prompt = prompts(1, 200, 200, seed=9)[0]
    copied = prompt[20:60] + prompt[100:150] + prompt[30:60]

    def copy(before: int, drawn: int) -> int:
        return copied[drawn % len(copied)]

    engine = make_engine(tiny_model)
    scripted_logits(engine, copy)
    done = run(engine, [Request("r", prompt, greedy(len(copied)))])
    assert done["r"].token_ids == copied
    stats = engine.stats()
    assert stats.draft_tokens_accepted > 0.7 * len(copied) and stats.steps < len(copied) / 3


def test_the_reasoning_budget_closes_the_block_where_it_would_without_drafts(qwen3_model):
    """A model that opens a think block, repeats itself, and answers once the block is closed: its n-grams draft
    the repetition past the budget, and the `</think>` the budget forces ends the row's run there."""
    engine = make_engine(qwen3_model)
    (opening, closing), (filler, answer) = engine.think_ids, engine.tokenizer.encode(" hmm ok")[:2]

    def thinking(before: int, drawn: int) -> int:
        return opening if drawn == 0 else answer if before in (closing, answer) else filler

    def outputs(engine) -> list[int]:
        scripted_logits(engine, thinking)
        params = SamplingParams(max_new_tokens=40, max_thinking_tokens=20, ignore_eos=True)
        return run(engine, [Request("r", engine.tokenizer.encode("Think about it."), params)])["r"].token_ids

    assert outputs(engine) == outputs(make_engine(qwen3_model, speculative="off"))
    assert outputs(make_engine(qwen3_model)) == [opening] + [filler] * 20 + [closing] + [answer] * 18
    assert engine.stats().draft_tokens_accepted > 10


def test_tensor_parallel_ranks_verify_drafts_as_one_rank_does(tiny_model):
    plain = run(make_engine(tiny_model, speculative="off"), greedy_requests())
    engine = make_engine(tiny_model, tensor_parallel=2)
    try:
        drafted = run(engine, greedy_requests(), {k: c.token_ids for k, c in plain.items()})
        assert engine.stats().draft_tokens_accepted > 0
    finally:
        engine.close()
    assert outcome(drafted) == outcome(plain)


def test_a_requests_own_setting_overrides_the_engines(tiny_model):
    on = make_engine(tiny_model, speculative="off")
    on.add_request(Request("a", [5, 6, 7], SamplingParams(4, speculative="ngram")))
    on.add_request(Request("b", [5, 6, 7], SamplingParams(4)))
    off = make_engine(tiny_model)
    off.add_request(Request("c", [5, 6, 7], SamplingParams(4, speculative="off")))
    off.add_request(Request("d", [5, 6, 7], SamplingParams(4)))
    assert [on._seqs[k].ngram is not None for k in "ab"] == [True, False]
    assert [off._seqs[k].ngram is not None for k in "cd"] == [False, True]


@pytest.mark.parametrize("grammar", [None, json_grammar(RECORD)], ids=["ngram", "forced"])
def test_drafts_go_to_small_steps_and_not_to_large_batches(tiny_model, grammar):
    """Under a cost model where a step's time grows with every token it computes (a busy accelerator), a row in
    a batch of one is worth drafting for and a row in a batch of 48 is not: neither n-gram drafts, at the chance
    a sequence's record gives them, nor, once a token costs more than a step's token is worth, even the tokens a
    grammar forces. The engine's sequences have kept half their n-gram drafts so far."""
    def drafted(batch: int, per_token: float) -> int:
        engine = make_engine(tiny_model, max_num_seqs=64)
        engine.scheduler.cost = FakeCost(fixed=0.004, per_token=per_token, per_row=5e-4)
        engine.scheduler.drafter.copied = Record(1.0, 2.0)
        requests = [Request(str(i), ids, SamplingParams(24, grammar=grammar))
                    for i, ids in enumerate(prompts(batch, 5, 20, seed=1))]
        reference = {r.request_id: list(range(100, 124)) for r in requests}
        run(engine, requests, reference, wrong=10**9, trusted=grammar is not None)
        return engine.stats().draft_tokens

    per_token = 5e-4 if grammar is None else 1e-3
    assert drafted(1, per_token) > 0 and drafted(48, per_token) == 0


def test_drafts_fill_the_time_limits_room_with_their_tokens_and_their_rows_cost(tiny_model):
    """The time limit leaves room for 13 tokens of compute; a row carrying drafts costs 2 tokens' time besides
    its drafts. Offered as many drafts as it can carry, the first row takes 8 (the most a row carries), which
    with its row's cost leaves 3; the second takes those 3, and the third none."""
    from engine.core.scheduler import Planning

    engine = make_engine(tiny_model)
    for i, ids in enumerate(prompts(3, 5, 20, seed=2)):
        engine.add_request(Request(str(i), ids, SamplingParams(24)))
    while any(seq.num_uncomputed != 1 for seq in engine._seqs.values()):
        engine.step()
    scheduler = engine.scheduler
    scheduler.cost = FakeCost(fixed=0.004, per_token=1e-3, per_row=5e-4, per_draft_row=2e-3)
    offered = []

    class Generous:  # a drafter that proposes every draft it is allowed, whatever they are worth
        def propose(self, seq, cap, price):
            offered.append((cap, round(price.row, 6)))
            return [7] * cap

    scheduler.drafter = Generous()
    planning = Planning(tokens_left=1000)
    seqs = list(engine._seqs.values())
    planning.add_decodes(seqs)
    scheduler._draft(planning, scheduler.cost.predict(planning.work) + 13e-3)
    assert offered == [(8, 2.0), (3, 2.0)]  # the third row is not even asked
    assert [planning.scheduled[seq] - 1 for seq in seqs] == [8, 3, 0]
    assert (planning.drafts, planning.draft_rows) == (11, 2)


# --- the sampled distribution --------------------------------------------------------------------------------------

CHAIN = [10, 11, 12, 13, 14, 15]  # a model whose next token depends only on the token before it, among these
TRANSITIONS = np.array([[0.30, 0.25, 0.15, 0.12, 0.10, 0.08], [0.05, 0.10, 0.40, 0.20, 0.15, 0.10],
                        [0.20, 0.20, 0.20, 0.20, 0.10, 0.10], [0.50, 0.05, 0.05, 0.10, 0.10, 0.20],
                        [0.10, 0.30, 0.10, 0.30, 0.10, 0.10], [0.15, 0.15, 0.15, 0.15, 0.20, 0.20]])


def chi_square_critical(dof: int, alpha: float) -> float:
    """The chi-square quantile 1 - `alpha` (Wilson and Hilferty's approximation)."""
    z = statistics.NormalDist().inv_cdf(1 - alpha)
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def markov_logits(engine) -> None:
    """The engine's logits at each sample position: log TRANSITIONS of the token there (no forward at all)."""
    table = torch.full((len(CHAIN), engine.model.shape.vocab_size), -math.inf)
    table[:, CHAIN] = torch.log(torch.tensor(TRANSITIONS, dtype=torch.float32))
    row_of = {token: i for i, token in enumerate(CHAIN)}

    def logits(plan):
        ends, tokens = np.cumsum(plan.counts).tolist(), plan.input_ids.tolist()
        before = []  # the token at each sample position: a row's last 1 + drafts tokens, in order
        for row in plan.sample_rows.tolist():
            k = int(plan.drafts[row]) if plan.drafts is not None else 0
            before += tokens[ends[row] - k - 1:ends[row]]
        return table[[row_of[t] for t in before]].clone()

    engine.executor.logits = logits


def test_sampling_with_drafts_draws_from_the_models_distribution(tiny_model):
    """Four tokens after a one-token prompt, 4,000 times, all four drawn in one step with three drafts (of
    every triple of tokens, so that some are accepted and most are not): the joint frequencies of each two
    tokens in a row against the chain's exact probabilities."""
    torch.manual_seed(0)
    engine = make_engine(tiny_model, max_num_seqs=256, max_num_batched_tokens=4096)
    engine.scheduler.cost = FakeCost(per_token=1e-7)  # a draft is always worth proposing
    markov_logits(engine)
    samples = 4000
    for i in range(samples):
        engine.add_request(Request(str(i), [CHAIN[0]], SamplingParams(4, temperature=1.0, ignore_eos=True)))
        oracle(engine._seqs[str(i)], [CHAIN[i % 6], CHAIN[i // 6 % 6], CHAIN[i // 36 % 6]], wrong=10**9)
    done = [c.token_ids for c in run_all(engine, []).values()]
    index = {token: i for i, token in enumerate(CHAIN)}
    marginal = TRANSITIONS[0]  # of the first token, which follows the prompt's
    for position in range(3):
        pairs = np.zeros((6, 6))
        for tokens in done:
            pairs[index[tokens[position]], index[tokens[position + 1]]] += 1
        expected = samples * marginal[:, None] * TRANSITIONS
        assert ((pairs - expected) ** 2 / expected).sum() < chi_square_critical(35, 0.001), position
        marginal = marginal @ TRANSITIONS
    stats = engine.stats()
    assert stats.draft_rows >= samples and 0 < stats.draft_tokens_accepted < stats.draft_tokens / 2
