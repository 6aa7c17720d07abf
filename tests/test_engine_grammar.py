"""Constrained decoding and log-probabilities in our engine: outputs that parse and validate, grammars that follow
their sequence through reasoning, pre-emption and cancels, and log-probabilities equal to transformers' own."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.structured import BUDGET, SCHEMAS
from engine.grammar_tags import structural_tag
from engine.interface import (
    ANY_OBJECT,
    GrammarKind,
    GrammarSpec,
    Request,
    RequestError,
    SamplingParams,
    ToolSchema,
)
from engine.model.sampler import mask
from engine.step import StepResult, TokenMasks
from tests.engine_helpers import json_grammar, kv_block_bytes, make_engine, prompts, run_all

pytestmark = pytest.mark.usefixtures("single_thread")


def constrained(max_new_tokens: int, schema: dict, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, grammar=json_grammar(schema), **kw)


def test_every_output_parses_and_validates_sampled_or_greedy(tiny_model):
    engine = make_engine(tiny_model)
    requests = [Request(f"{i}", p, constrained(BUDGET, SCHEMAS[i % len(SCHEMAS)], temperature=1.0 if i % 2 else 0.0,
                                               seed=i))
                for i, p in enumerate(prompts(24, 5, 60, seed=1))]
    done = run_all(engine, requests)
    for i, completion in done.items():
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMAS[int(i) % len(SCHEMAS)])  # strict: no raw controls
    assert not engine._constrained


def test_json_object_and_a_budget_that_runs_out_mid_object(tiny_model):
    engine = make_engine(tiny_model)
    any_object = SamplingParams(max_new_tokens=200, temperature=1.0, seed=3, grammar=GrammarSpec(GrammarKind.JSON_SCHEMA))
    short = constrained(4, SCHEMAS[0])
    done = run_all(engine, [Request("any", prompts(1, 8, 8)[0], any_object), Request("short", [5, 6, 7], short)])
    assert done["short"].finish_reason == "length" and '{"category": "'.startswith(done["short"].text)
    if done["any"].finish_reason == "stop":
        assert isinstance(json.loads(done["any"].text), dict)
    else:
        assert done["any"].text.startswith("{")


def test_the_grammar_ends_an_output_that_ignores_eos(tiny_model):
    engine = make_engine(tiny_model)
    done = run_all(engine, [Request("r", [9, 10, 11], constrained(200, SCHEMAS[0], ignore_eos=True))])["r"]
    assert done.finish_reason == "stop"
    jsonschema.validate(json.loads(done.text), SCHEMAS[0])


def test_a_schema_the_compiler_cannot_take_is_refused_by_name_and_a_known_one_is_compiled_once(tiny_model):
    engine = make_engine(tiny_model)
    with pytest.raises(RequestError, match=r'grammar: .*"objectx"'):
        engine.add_request(Request("bad", [1, 2], constrained(8, {"type": "objectx"})))
    no_json = GrammarSpec(GrammarKind.FORCED_CALL, tools=(ToolSchema("f", '{"type": '),))
    with pytest.raises(RequestError, match=r"grammar: .*Failed to parse JSON"):
        engine.add_request(Request("bad", [1, 2], SamplingParams(max_new_tokens=8, grammar=no_json)))
    grammars = engine.grammars
    assert grammars.compiled(json_grammar(SCHEMAS[1])) is grammars.compiled(json_grammar(SCHEMAS[1]))


def test_grammars_follow_their_sequences_through_preemption_and_cancels(tiny_model):
    """A KV budget far too small for the work: sequences are pre-empted and recomputed, each keeping its matcher;
    a cancel frees one mid-output."""
    engine = make_engine(tiny_model, kv_cache_memory=24 * kv_block_bytes(tiny_model), initial_blocks=8,
                         max_num_batched_tokens=96, prefill_chunk_size=64, max_num_seqs=16)
    schema = SCHEMAS[1] | {"properties": {"items": SCHEMAS[1]["properties"]["items"] | {"maxItems": 40}}}
    requests = [Request(f"{i}", p, constrained(120, schema, temperature=1.0, seed=i))
                for i, p in enumerate(prompts(12, 30, 90, seed=2))]
    for request in requests:
        engine.add_request(request)
    done, steps = {}, 0
    while engine.has_unfinished():
        steps += 1
        if steps == 6:
            assert engine.abort_request("0").finish_reason == "cancelled"
        for completion in engine.step():
            done[completion.request_id] = completion
    assert engine.stats().preemptions > 0
    for completion in done.values():
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), schema)
        else:
            assert completion.finish_reason == "length" and completion.text.startswith('{"items": [')
    assert "0" not in done and not engine._constrained


def test_unconstrained_rows_are_untouched_by_constrained_batch_mates(tiny_model):
    alone = run_all(make_engine(tiny_model), [Request(f"{i}", p, SamplingParams(max_new_tokens=12, ignore_eos=True))
                                              for i, p in enumerate(prompts(6, 5, 40, seed=4))])
    engine = make_engine(tiny_model)
    mixed = [Request(f"{i}", p, SamplingParams(max_new_tokens=12, ignore_eos=True))
             for i, p in enumerate(prompts(6, 5, 40, seed=4))]
    mixed += [Request(f"c{i}", p, constrained(60, SCHEMAS[i % 4])) for i, p in enumerate(prompts(6, 5, 40, seed=4))]
    together = run_all(engine, mixed)
    assert [together[str(i)].token_ids for i in range(6)] == [alone[str(i)].token_ids for i in range(6)]


def test_with_thinking_the_reasoning_is_free_and_the_answer_constrained(qwen3_model):
    engine = make_engine(qwen3_model, speculative="off")  # the script replaces the one token a row samples
    tokenizer = engine.tokenizer
    opening, closing = engine.think_ids
    reasoning = [opening, *tokenizer.encode(" no JSON here {{{"), closing]
    run = engine.executor.run
    # the model opens a think block and says something no grammar allows, then goes on by itself
    def scripted(plan, masks=None):
        result = run(plan, masks)
        drawn = plan.sampling.drawn.tolist()
        tokens = [reasoning[n] if n < len(reasoning) else t for n, t in zip(drawn, result.token_ids, strict=True)]
        return StepResult(result.request_ids, tokens, result.logprobs)

    engine.executor.run = scripted
    params = constrained(80, SCHEMAS[0], grammar_after_think=True, temperature=1.0, seed=5)
    done = run_all(engine, [Request("r", tokenizer.encode("Summarize: the parcel came late."), params)])["r"]
    assert done.token_ids[:len(reasoning)] == reasoning
    answer = tokenizer.decode(done.token_ids[len(reasoning):], skip_special_tokens=True)
    jsonschema.validate(json.loads(answer), SCHEMAS[0])


def test_logprobs_are_transformers_log_softmax_of_the_tokens_drawn(tiny_model):
    engine = make_engine(tiny_model)
    prompt = prompts(1, 12, 12, seed=6)[0]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=5)
    done = run_all(engine, [Request("r", prompt, params), Request("other", prompt[:5], SamplingParams(8))])
    completion = done["r"]
    assert done["other"].logprobs is None and len(completion.logprobs) == len(completion.token_ids) == 8
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1:-1]
    expected = torch.log_softmax(logits, -1)
    for position, (token, (logprob, top)) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        assert logprob == pytest.approx(expected[position, token].item(), abs=1e-4)
        assert [t for t, _ in top] == expected[position].topk(5).indices.tolist()
        assert [lp for _, lp in top] == pytest.approx(expected[position].topk(5).values.tolist(), abs=1e-4)
        assert top[0][0] == token  # greedy


def test_logprobs_under_a_grammar_count_only_what_it_allows(tiny_model):
    engine = make_engine(tiny_model)
    done = run_all(engine, [Request("r", [7, 8, 9], constrained(60, SCHEMAS[0], logprobs=3))])["r"]
    first_logprob, first_top = done.logprobs[0]
    assert first_logprob == 0.0 and first_top[0][1] == 0.0  # `{` is the only token the grammar allows first
    assert all(lp == float("-inf") for _, lp in first_top[1:])


@pytest.mark.parametrize("string", [{"type": "string", "maxLength": 5}, {"type": "string"}], ids=["bounded", "free"])
def test_json_strings_hold_only_what_json_and_utf8_allow(tiny_model, string):
    """No raw control character (json.loads refuses them) and no UTF-8 bytes of a surrogate (no decoder takes
    them), both of which xgrammar's own string rules let through."""
    grammars = make_engine(tiny_model).grammars
    vocab = grammars.info.decoded_vocab
    schema = {"type": "object", "properties": {"s": string}, "required": ["s"]}

    def inside_string():
        matcher = grammars.matcher(json_grammar(schema))
        assert matcher.accept_string('{"s": "a')
        return matcher

    assert not inside_string().accept_string("\x06")
    matcher = inside_string()
    assert matcher.accept_token(vocab.index(b"\xed"))  # the lead byte of U+D000..U+DFFF
    assert not matcher.accept_token(vocab.index(b"\xbd"))  # U+DF40..: a surrogate
    assert matcher.accept_token(vocab.index(b"\x9d"))  # U+D740..: a character


def test_host_masking_does_what_xgrammars_kernel_does():
    """Rows of both kinds `mask_host` tells apart (most words 0: a few tokens allowed; most words full: a few
    forbidden) and mixed ones, with logits narrower than the mask's words (a vocabulary not a multiple of 32)."""
    from xgrammar import apply_token_bitmask_inplace

    torch.manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (40, 128), dtype=torch.int32)
    bitmask[:15, 4:] = 0  # a few allowed
    bitmask[15:30, :120] = -1  # a few forbidden
    bitmask[38], bitmask[39] = 0, -1  # nothing allowed; everything allowed
    for vocab in (4096, 4090):
        logits = torch.randn(40, vocab)
        masks = TokenMasks([*range(0, 40, 2), 1, 3, 15, 29, 31, 39], bitmask)
        ours, theirs = logits.clone(), logits.clone()
        mask(ours, masks)
        apply_token_bitmask_inplace(theirs, bitmask, indices=masks.rows)
        assert torch.equal(ours, theirs) and not torch.equal(ours, logits)
        assert torch.equal(ours[5], logits[5])  # a row without a grammar
        assert torch.isinf(ours[0]).sum() > vocab - 200 and torch.isinf(ours[16]).sum() < 200
        assert torch.isinf(ours[38]).all() and torch.equal(ours[39], logits[39])


def test_a_tool_call_block_is_json_whatever_the_tools_name_holds():
    """The contract allows only plain names, but the engine's spec is for any caller: a quote or a backslash in a
    name is escaped in the call's JSON, not spliced in as written."""
    name = 'say "hi"\\now'
    tag = json.loads(structural_tag(GrammarSpec(GrammarKind.FORCED_CALL, tools=(ToolSchema(name, ANY_OBJECT),))))
    block = tag["format"]["begin"] + "{}" + tag["format"]["end"]
    assert block.startswith("<tool_call>\n") and block.endswith("\n</tool_call>")
    assert json.loads(block.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")) == {
        "name": name, "arguments": {}}
