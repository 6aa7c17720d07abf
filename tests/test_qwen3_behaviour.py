"""A real Qwen3 folder's behaviour (its tokenizer, chat template and generation config around small random
weights): thinking on and off, the reasoning kept apart from the answer, the model's sampling defaults, the
sampling options Qwen3's users set (min_p, repetition and presence penalties), stop strings and `<|im_end|>`,
and a multilingual prompt token-identical to transformers."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from api.service.batch_input import parse_batch
from engine.core.output_text import finish_text
from engine.hf_backend import HFEngine, _ThinkingBudget
from engine.interface import Completion, EngineStats, Request, SamplingParams
from engine.model.sampler import penalize, sample
from engine.runtime.engine_thread import EngineThread
from engine.step import StepResult
from jobs.chat import chat_for, encode_chat, problem, split_reasoning, thinking_of
from jobs.schemas import JobIn
from jobs.settings import Settings
from jobs.tool_calls import template_tools
from tests.engine_helpers import greedy, make_engine, run_all, sampling_rows
from tests.test_tools import ANSWERED, ASK, CALLED, TICKET, WEATHER
from worker.bridge import Bridge
from worker.claims import claim
from worker.outcome import Outcome
from worker.reply import reply
from worker.sampling import OURS, sampling_params

pytestmark = pytest.mark.usefixtures("single_thread")

THINK, END_THINK, IM_END, IM_START = 151667, 151668, 151645, 151644


@pytest.fixture(scope="module")
def tokenizer(qwen3_model):
    return AutoTokenizer.from_pretrained(qwen3_model)


def job(text: str = "Where is my parcel?", **extra) -> JobIn:
    return JobIn(messages=[{"role": "user", "content": text}], **extra)


# --- thinking ---------------------------------------------------------------------------------------------------

def test_the_chat_template_renders_thinking_on_and_off(tokenizer):
    chat = chat_for(job())
    off = tokenizer.decode(encode_chat(tokenizer, chat, thinking=False))
    on = tokenizer.decode(encode_chat(tokenizer, chat, thinking=True))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # the answer starts at once
    assert on.endswith("<|im_start|>assistant\n")  # the model opens <think> itself
    # unset: summaries never think, chats by the default
    assert not thinking_of(job(kind="summarize"), default_thinking=True)
    assert thinking_of(job(), default_thinking=True) and not thinking_of(job(), default_thinking=False)
    assert not thinking_of(job(thinking=False), default_thinking=True)


def test_reasoning_is_split_from_the_answer():
    assert split_reasoning("<think>\nCheck the tracking first.\n</think>\n\nIt ships today.") == (
        "Check the tracking first.", "It ships today.")
    assert split_reasoning("It ships today.") == (None, "It ships today.")
    assert split_reasoning("<think>\nstill thinking when the budget ran out") == (
        "still thinking when the budget ran out", "")
    assert split_reasoning("Answer first <think>odd</think>") == (None, "Answer first <think>odd</think>")


class ScriptedEngine:
    """Answers every request with the same scripted tokens, decoded by the real tokenizer."""

    def __init__(self, tokenizer, script: list[int]) -> None:
        self.tokenizer, self.script, self.max_model_len = tokenizer, script, 4096
        self.waiting: list[Request] = []

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Completion | None:
        return None

    def partial(self, request_id: str, at_least: int) -> list[int] | None:
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def step(self) -> list[Completion]:
        done, self.waiting = self.waiting, []
        return [Completion(r.request_id, self.script, self.tokenizer.decode(self.script, skip_special_tokens=True),
                           len(r.prompt_ids), "stop") for r in done]

    def stats(self) -> EngineStats:
        return EngineStats()


@pytest.mark.parametrize("thinking", [True, False])
def test_a_thinking_reply_keeps_its_reasoning_apart_and_counts_every_token(tokenizer, thinking):
    script = [THINK, *tokenizer.encode("\nThe customer wants the date.\n"), END_THINK,
              *tokenizer.encode("\n\nTomorrow before noon."), IM_END]
    bridge = Bridge(EngineThread(ScriptedEngine(tokenizer, script)), Settings())
    try:
        with bridge.run("j1", job(thinking=thinking), datetime.now(UTC)) as run:
            outcome = reply(run)
    finally:
        bridge.close()
    if thinking:
        assert outcome.reasoning == "The customer wants the date." and outcome.completion.text == "Tomorrow before noon."
    else:  # not asked for: nothing is taken out of the text
        assert outcome.reasoning is None and outcome.completion.text.startswith("<think>")
    assert len(outcome.completion.token_ids) == len(script)  # the reasoning's tokens count too


def test_the_engine_closes_the_think_block_at_the_budget(qwen3_model, tokenizer, monkeypatch):
    engine = make_engine(qwen3_model, speculative="off")  # the script replaces the one token a row samples
    filler = tokenizer.encode(" hmm")[0]
    script = iter([THINK] + [filler] * 100)
    run = engine.executor.run
    # the model's own choices, except that it opens a think block and then only ever says " hmm"
    def scripted(plan, masks=None):
        sampled = run(plan, masks).request_ids
        return StepResult(sampled, [next(script) for _ in sampled])

    monkeypatch.setattr(engine.executor, "run", scripted)
    params = SamplingParams(max_new_tokens=12, max_thinking_tokens=5, ignore_eos=True)
    done = run_all(engine, [Request("r", encode_chat(tokenizer, chat_for(job()), True), params)])["r"]
    assert done.token_ids[:7] == [THINK] + [filler] * 5 + [END_THINK]  # forced after 5 tokens of reasoning
    reasoning, answer = split_reasoning(done.text)
    assert reasoning == "hmm" * 5 or reasoning.split() == ["hmm"] * 5
    assert answer and len(done.token_ids) == 12  # and then it answers, within max_new_tokens


def test_the_reference_backend_closes_the_think_block_at_the_same_point():
    budget = _ThinkingBudget(start=2, budget=3, think_ids=(THINK, END_THINK))
    ids = torch.tensor([[1, 2, THINK, 7, 7, 7], [1, 2, THINK, 7, END_THINK, 7], [1, 2, THINK, 7, 7, 9]])
    scores = budget(ids[:, :6], torch.zeros(3, 151936))
    assert scores[0].argmax() == END_THINK and torch.isinf(scores[0]).sum() == 151935
    assert not torch.isinf(scores[1]).any()  # already closed
    assert scores[2].argmax() == END_THINK


# --- the model's sampling defaults and the new options ------------------------------------------------------------

def test_the_model_generation_config_fills_unset_sampling_fields(qwen3_model):
    engine = make_engine(qwen3_model)
    auto = Bridge.for_settings(EngineThread(engine), Settings(model=str(qwen3_model)))
    none = Bridge.for_settings(EngineThread(engine), Settings(model=str(qwen3_model), generation_config="none"))
    try:
        with auto.run("a", job(), datetime.now(UTC)) as run:
            p = run.sampling
        assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 20)  # Qwen3's published defaults
        with auto.run("b", job(sampling={"temperature": 0.2, "top_k": 0}), datetime.now(UTC)) as run:
            p = run.sampling
        assert (p.temperature, p.top_p, p.top_k) == (0.2, 0.95, 0)  # what a job says wins, field by field
        with none.run("c", job(), datetime.now(UTC)) as run:
            assert run.sampling.temperature == 0.0 and run.sampling.top_k == 0  # ours: greedy
    finally:
        auto.close()
        none.close()


def test_the_tiny_checkpoint_without_sampling_defaults_stays_greedy(tiny_model):
    bridge = Bridge.for_settings(EngineThread(make_engine(tiny_model)), Settings(model=str(tiny_model)))
    try:
        assert bridge.sampling_defaults == OURS
    finally:
        bridge.close()


class Row:
    def __init__(self, params: SamplingParams, prompt: list[int], output: list[int], seed: int | None = None):
        self.params = params if seed is None else replace(params, seed=seed)
        self.token_ids, self.num_prompt_tokens = prompt + output, len(prompt)


def test_repetition_and_presence_penalties_match_their_definitions():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    logits[:, [1, 2, 3, 4]] += 6.0  # the tokens the penalties touch are the favourites before them
    rows = [Row(SamplingParams(8, repetition_penalty=1.7), [1, 2, 3], [4, 4]),
            Row(SamplingParams(8, presence_penalty=1.5), [1, 2, 3], [4, 9]),
            Row(SamplingParams(8), [1, 2], [3])]
    expected = logits.clone()
    # transformers' repetition penalty, over prompt and output
    expected[0] = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([[1, 2, 3, 4, 4]]), logits[0:1].clone())[0]
    expected[1, [4, 9]] -= 1.5  # OpenAI's presence penalty: output tokens only, once each
    assert torch.allclose(penalize(logits.clone(), sampling_rows(rows)), expected)
    assert sample(logits.clone(), sampling_rows(rows))[0] == expected.argmax(-1).tolist()


def test_vectorized_filters_keep_what_transformers_keeps():
    torch.manual_seed(1)
    logits = torch.randn(4, 300) * 3
    params = [SamplingParams(8, temperature=0.7, top_k=20), SamplingParams(8, temperature=1.0, top_p=0.8),
              SamplingParams(8, temperature=0.9, min_p=0.1), SamplingParams(8, temperature=1.3, top_k=50, top_p=0.9,
                                                                            min_p=0.05)]
    draws = {i: set() for i in range(4)}
    rows = [Row(p, [1], [], seed=None) for p in params]
    for _ in range(300):
        for i, token in enumerate(sample(logits.clone(), sampling_rows(rows))[0]):
            draws[i].add(token)
    for i, p in enumerate(params):
        scores = logits[i:i + 1] / p.temperature
        if p.top_k:
            scores = scores.masked_fill(scores < scores.topk(p.top_k).values[..., -1:], float("-inf"))
        if p.top_p < 1:
            sorted_scores, order = scores.sort(descending=True)
            probs = sorted_scores.softmax(-1)
            drop = probs.cumsum(-1) - probs >= p.top_p
            scores = scores.scatter(1, order, sorted_scores.masked_fill(drop, float("-inf")))
        if p.min_p:
            scores = MinPLogitsWarper(p.min_p)(None, scores)
        allowed = set(torch.isfinite(scores[0]).nonzero()[:, 0].tolist())
        assert draws[i] <= allowed and len(draws[i]) >= min(3, len(allowed))


def test_seeded_rows_draw_the_same_whatever_their_batch_mates():
    logits = torch.randn(3, 100)
    p = SamplingParams(8, temperature=1.0, top_p=0.9)
    alone = [sample(logits[:1].clone(), sampling_rows([Row(p, [1], [], seed=7)]))[0][0] for _ in range(3)]
    rows = [Row(p, [1], [], seed=7), Row(p, [1], []), Row(SamplingParams(8), [1], [])]
    mixed = [sample(logits.clone(), sampling_rows(rows))[0][0] for _ in range(3)]
    assert alone == mixed


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=1.3), dict(presence_penalty=1.2)])
def test_penalized_greedy_output_equals_the_reference_backend(tiny_model, penalty):
    prompt = encode_chat(AutoTokenizer.from_pretrained(tiny_model), [{"role": "user", "content": "order 7 late"}],
                         False)
    params = SamplingParams(24, ignore_eos=True, **penalty)
    ours = run_all(make_engine(tiny_model), [Request("p", prompt, params)])["p"].token_ids
    reference = HFEngine(str(tiny_model))
    reference.add_request(Request("p", prompt, params))
    [theirs] = reference.step()
    plain = run_all(make_engine(tiny_model), [Request("p", prompt, greedy(24))])["p"].token_ids
    assert ours == theirs.token_ids and ours != plain  # the penalty changed the output, the same way in both


# --- prompts -----------------------------------------------------------------------------------------------------

PROMPTS = [
    job(),
    job("我的包裹在哪里？ Où est mon colis ? أين طردي؟ 🚚📦"),
    JobIn(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                    {"role": "assistant", "content": "<think>\nok\n</think>\n\nHi! How can I help?"},
                    {"role": "user", "content": "  where is it \n\n"}]),
    JobIn.model_validate({"messages": [ASK, CALLED, ANSWERED], "tools": [WEATHER, TICKET]}),
    job("A long transcript line. " * 300, kind="summarize"),
    job("A long question. " * 300),
]


@pytest.mark.parametrize("thinking", [False, True])
def test_a_prompt_is_the_chat_templates_own_tokenization(tokenizer, thinking):
    """`encode_chat` calls the Rust tokenizer itself (`jobs.chat.encode_rendered`): token for token what
    `apply_chat_template(tokenize=True)` gives, with a job's tools. (Control tokens' names typed by a customer
    are text instead: `tests/test_control_tokens.py`.)"""
    for prompt_job in PROMPTS:
        chat, tools = chat_for(prompt_job), template_tools(prompt_job)
        theirs = tokenizer.apply_chat_template([dict(m) for m in chat], tools=tools, add_generation_prompt=True,
                                               tokenize=True, enable_thinking=thinking)
        assert encode_chat(tokenizer, chat, thinking, tools) == list(theirs["input_ids"])


def test_a_tokenizer_left_truncating_is_called_through_transformers(qwen3_model):
    """Transformers' call resets a truncation left on the Rust tokenizer; the direct call would keep it."""
    tokenizer = AutoTokenizer.from_pretrained(qwen3_model)
    long = PROMPTS[-1]
    full = encode_chat(tokenizer, chat_for(long), False)
    tokenizer.backend_tokenizer.enable_truncation(8)
    assert encode_chat(tokenizer, chat_for(long), False) == full and len(full) > 8
    # the API's check counts the same tokens: this prompt does not fit a context of its own length
    assert problem(long, tokenizer, len(full), False)[0] == "messages"


def test_a_tokenizer_that_splits_special_tokens_is_called_through_transformers(qwen3_model):
    """Loaded to read control tokens as text, a tokenizer gives what transformers' own tokenization gives: the
    template's `<|im_start|>` spelled out, even after a call that asked otherwise left its Rust tokenizer reading
    them as control tokens."""
    tokenizer = AutoTokenizer.from_pretrained(qwen3_model, split_special_tokens=True)
    tokenizer("<|im_start|>", split_special_tokens=False)
    assert not tokenizer.backend_tokenizer.encode_special_tokens
    chat = chat_for(PROMPTS[2])  # with an earlier answer's reasoning
    ours = encode_chat(tokenizer, chat, False)  # first: transformers' call sets the Rust tokenizer back
    theirs = tokenizer.apply_chat_template([dict(m) for m in chat], add_generation_prompt=True, tokenize=True,
                                           enable_thinking=False)
    assert ours == list(theirs["input_ids"]) and IM_START not in ours


# --- text endings and a multilingual prompt -----------------------------------------------------------------------

def test_im_end_and_stop_strings_end_the_text(qwen3_model, tokenizer):
    engine = make_engine(qwen3_model)
    assert {IM_END, 151643} <= engine.eos_ids  # <|im_end|> and <|endoftext|>, from the generation config
    ids = [*tokenizer.encode("Your refund is on its way."), IM_END, *tokenizer.encode(" ignored")]
    kept, text, ended = finish_text(tokenizer, ids, (), engine.eos_ids)
    assert text == "Your refund is on its way." and ended and IM_END not in kept
    prompt = encode_chat(tokenizer, [{"role": "user", "content": "Bonjour"}], False)
    free = run_all(engine, [Request("a", prompt, greedy(24))])["a"].text
    stop = free[len(free) // 2:len(free) // 2 + 3]
    cut = run_all(engine, [Request("b", prompt, SamplingParams(24, stop=(stop,), ignore_eos=True))])["b"]
    assert cut.finish_reason == "stop" and cut.text == free[:free.index(stop)]


def test_a_multilingual_prompt_generates_what_transformers_generates(qwen3_model, tokenizer):
    text = "我的包裹在哪里？ Où est mon colis ? أين طردي؟ 🚚📦"
    prompt = encode_chat(tokenizer, [{"role": "user", "content": text}], False)
    assert text in tokenizer.decode(prompt)  # byte-level BPE: every script round-trips
    ours = run_all(make_engine(qwen3_model), [Request("m", prompt, greedy(16))])["m"].token_ids
    model = AutoModelForCausalLM.from_pretrained(qwen3_model, dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=151643)
    assert ours == theirs[0, len(prompt):].tolist()


# --- the contract -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [{"sampling": {"min_p": 1.0}}, {"sampling": {"repetition_penalty": 0}},
                                 {"sampling": {"presence_penalty": 3}}, {"max_thinking_tokens": 0},
                                 {"thinking": "maybe"}])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError):
        JobIn.model_validate({"messages": [{"role": "user", "content": "hi"}], **bad})


def test_batch_lines_say_thinking_and_sampling_as_vllm_clients_do():
    lines = [
        b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", '
        b'"content": "hi"}], "chat_template_kwargs": {"enable_thinking": true}, "min_p": 0.05, "presence_penalty": 0.5}}',
        b'{"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", '
        b'"content": "hi"}], "frequency_penalty": 0.4}}',
        b'{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", '
        b'"content": "hi"}], "chat_template_kwargs": {"tools": []}}}',
        b'{"custom_id": "d", "transcript": "long call", "thinking": true, "max_thinking_tokens": 64, "top_k": 20}',
    ]
    parsed, errors, total = parse_batch(b"\n".join(lines), priority=1)
    by_id = {p.custom_id: p.job for p in parsed}
    assert total == 4 and set(by_id) == {"a", "d"}
    assert by_id["a"].thinking is True and by_id["a"].sampling.min_p == 0.05
    assert by_id["a"].sampling.presence_penalty == 0.5 and by_id["a"].sampling.temperature is None
    assert by_id["d"].thinking and by_id["d"].max_thinking_tokens == 64 and by_id["d"].sampling.top_k == 20
    messages = {e.custom_id: e.message for e in errors}
    assert "frequency_penalty" in messages["b"] and "enable_thinking" in messages["c"]


def test_sampling_params_carry_every_field():
    p = sampling_params(job(sampling={"min_p": 0.1, "repetition_penalty": 1.1, "presence_penalty": 0.3},
                            max_thinking_tokens=9), {**OURS, "temperature": 0.6})
    assert (p.temperature, p.min_p, p.repetition_penalty, p.presence_penalty, p.max_thinking_tokens) == (
        0.6, 0.1, 1.1, 0.3, 9)
    assert Outcome.answered(Completion("x", [1], "<think>r</think>a", 1, "stop"), 1.0, True).reasoning == "r"


def test_stored_reasoning_reaches_the_api_and_batch_output(database):
    from api.service.batch_output import completion
    from api.service.jobs import load
    from jobs.settings import ApiKey
    from jobs.tables import Job, Result
    from store.connections import make_db_engine, make_sessions
    from tests.test_worker_results import new_job
    from worker import results

    sessions = make_sessions(make_db_engine(database))
    job_id = new_job(sessions)
    outcome = Outcome.answered(Completion(job_id, [1, 2, 3], "<think>\nweigh it\n</think>\n\nYes.", 5, "stop"), 1.0,
                               thinking=True)
    results.store(sessions, claim(sessions, job_id, "w", 3), outcome, "w")
    out = load(sessions, job_id, ApiKey("0" * 64, frozenset({"admin"}), "operators"))
    assert (out.result.reasoning, out.result.text, out.result.completion_tokens) == ("weigh it", "Yes.", 3)
    with sessions() as session:
        row = completion(session.get(Job, out.id), session.get(Result, out.id), "Qwen/Qwen3-8B")
    assert row["choices"][0]["message"] == {"role": "assistant", "content": "Yes.", "reasoning_content": "weigh it"}
    assert row["model"] == "Qwen/Qwen3-8B" and row["usage"]["completion_tokens"] == 3
