"""A grammar's compile cannot hurt its engine: it runs on the compiler's own thread within a time limit, a
failure of any kind (a timeout, out of memory, a bad schema) is its request's error, the cache of compiled
grammars is bounded by their bytes, and in an engine process the submits and cancels behind a long compile are
served meanwhile."""

from __future__ import annotations

import functools
import threading
import time

import pytest
from transformers import AutoTokenizer

from engine import grammar
from engine.interface import GrammarSpec, Request, RequestError, SamplingParams
from engine.runtime.engine_process import EngineProcess
from engine.runtime.engine_thread import EngineThread
from tests import gated_grammar
from tests.engine_helpers import json_grammar, make_engine


def schema(i: int, **extra) -> dict:
    return {"type": "object", "properties": {f"field_{i}": {"type": "integer"}}, "required": [f"field_{i}"], **extra}


def test_a_compile_past_its_limit_fails_its_request_and_is_kept_once_done(tiny_model, monkeypatch):
    gate = threading.Event()
    monkeypatch.setattr(grammar, "grammar_of", lambda s, real=grammar.grammar_of: gate.wait(30) and real(s))
    grammars = make_engine(tiny_model, grammar_compile_s=0.2).grammars
    with pytest.raises(RequestError, match=r"not compiled within 0.2s \(CONVOQ_GRAMMAR_COMPILE_S\)"):
        grammars.compiled(json_grammar(schema(1)))
    gate.set()
    deadline = time.monotonic() + 30
    while grammars.cached_bytes == 0 and time.monotonic() < deadline:  # the compile went on to its end
        time.sleep(0.01)
    assert grammars.compiled(json_grammar(schema(1))) is grammars.compiled(json_grammar(schema(1)))


def test_running_out_of_memory_while_compiling_is_the_requests_error(tiny_model, monkeypatch):
    def out_of_memory(spec: GrammarSpec):
        raise MemoryError

    thread = EngineThread(make_engine(tiny_model))
    try:
        monkeypatch.setattr(grammar, "grammar_of", out_of_memory)
        failed = thread.submit(Request("r", [5, 6, 7], SamplingParams(4, grammar=json_grammar(schema(1))))).result(60)
        assert failed.finish_reason == "error" and "grammar: out of memory" in failed.error
        free = thread.submit(Request("free", [5, 6, 7], SamplingParams(4, ignore_eos=True))).result(60)
        assert free.finish_reason == "length" and thread.alive
    finally:
        thread.close()


def test_the_cache_of_compiled_grammars_is_bounded_by_their_bytes(tiny_model):
    grammars = make_engine(tiny_model).grammars
    size = grammars.compiled(json_grammar(schema(0))).memory_size_bytes
    grammars.cache_bytes = int(2.5 * size)
    first, second = grammars.compiled(json_grammar(schema(1))), grammars.compiled(json_grammar(schema(2)))
    grammars.compiled(json_grammar(schema(3)))
    assert grammars.cached_bytes <= grammars.cache_bytes
    assert grammars.compiled(json_grammar(schema(1))) is not first  # the oldest went, and was compiled again
    assert grammars.compiled(json_grammar(schema(3))) is grammars.compiled(json_grammar(schema(3)))
    assert second is not None
    grammars.cache_bytes = size // 2  # one larger than the whole cache is not kept
    huge = json_grammar(schema(9, title="huge"))
    assert grammars.compiled(huge) is not grammars.compiled(huge)


@pytest.fixture
def gated_process(tiny_model, tmp_path):
    runner = EngineProcess(functools.partial(gated_grammar.create, str(tiny_model)),
                           AutoTokenizer.from_pretrained(tiny_model))
    yield runner, tmp_path / "open"
    (tmp_path / "open").touch()
    runner.close()


def test_submits_and_cancels_reach_an_engine_process_while_a_grammar_compiles(gated_process):
    runner, gate = gated_process
    slow = Request("slow", [5, 6, 7], SamplingParams(8, grammar=json_grammar(schema(1, title=f"gate:{gate}"))))
    waiting = runner.submit(slow)
    also = runner.submit(Request("also", [5, 6, 7], SamplingParams(8, grammar=json_grammar(schema(2, title=f"gate:{gate}")))))
    time.sleep(0.2)
    free = runner.submit(Request("free", [5, 6, 9], SamplingParams(4, ignore_eos=True)))
    assert free.result(30).finish_reason == "length"
    runner.cancel("slow")
    assert waiting.result(30).finish_reason == "cancelled" and not also.done()
    gate.touch()
    done = also.result(30)
    assert done.finish_reason in ("stop", "length") and done.text.startswith('{"field_2')  # its grammar's
