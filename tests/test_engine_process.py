"""The engine in a process of its own: the same completions as in a thread, progress, cancels, and death
noticed at once (a killed engine, a parent that goes away, signals meant for the worker)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

from engine.interface import EngineDead, EngineStats, Request, SamplingParams
from engine.runtime.engine_process import EngineProcess
from engine.runtime.engine_thread import EngineThread
from worker.engine_factory import WorkerSettings, load_backend


def engine_factory(model) -> functools.partial:
    return functools.partial(load_backend, WorkerSettings(model=str(model), device="cpu", kv_cache_memory=2**24))


def broken_factory():
    raise ValueError("no such weights")


class CrashOnAdd:
    """An engine whose loop crashes on the first request it takes in (a bug, not a bad request)."""

    tokenizer = None
    max_model_len = 64

    def add_request(self, request: Request) -> None:
        raise TypeError("a bug in add_request")

    def has_unfinished(self) -> bool:
        return False

    def stats(self) -> EngineStats:
        return EngineStats()


def crash_on_add_factory() -> CrashOnAdd:
    return CrashOnAdd()


def requests(n: int, max_new_tokens: int = 12) -> list[Request]:
    return [Request(f"r{i}", [1 + i, 7, 3 + 2 * i, 9], SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
            for i in range(n)]


@pytest.fixture(scope="module")
def process(tiny_model):
    deaths: list[EngineDead] = []
    runner = EngineProcess(engine_factory(tiny_model), AutoTokenizer.from_pretrained(tiny_model),
                           on_death=deaths.append)
    runner.deaths = deaths
    yield runner
    runner.close()


def test_completions_and_progress_match_the_engine_in_a_thread(process, tiny_model):
    thread = EngineThread(load_backend(WorkerSettings(model=str(tiny_model), device="cpu", kv_cache_memory=2**24)))
    try:
        expected = [f.result(60) for f in [thread.submit(r) for r in requests(6)]]
    finally:
        thread.close()
    seen: list[list[int]] = []
    futures = [process.submit(r, on_tokens=seen.append if r.request_id == "r0" else None) for r in requests(6)]
    got = [f.result(60) for f in futures]
    assert [(c.request_id, c.token_ids, c.text, c.finish_reason) for c in got] == \
        [(c.request_id, c.token_ids, c.text, c.finish_reason) for c in expected]
    assert process.max_model_len == thread.max_model_len
    # progress comes over as the tokens added, and is handed on as the whole output so far
    assert seen and all(got[0].token_ids[:len(s)] == s for s in seen) and len(seen[-1]) > len(seen[0])
    stats = process.stats()
    assert stats.tokens_generated >= 6 * 12 and stats.loop_gaps > 0


def test_a_cancel_reaches_a_request_in_the_process(process):
    [long] = requests(1, max_new_tokens=900)
    future = process.submit(long)
    time.sleep(0.3)
    process.cancel(long.request_id, "expired")
    done = future.result(60)
    assert done.finish_reason == "expired" and 0 < len(done.token_ids) < 900


def test_signals_for_the_worker_do_not_reach_the_engine(process):
    os.kill(process.pid, signal.SIGTERM)  # a warm shutdown signals the whole process group
    os.kill(process.pid, signal.SIGINT)
    os.kill(process.pid, signal.SIGQUIT)  # a cold one
    time.sleep(0.2)
    assert process.alive and process.submit(requests(1, 2)[0]).result(60).finish_reason == "length"


def test_a_killed_engine_fails_what_is_pending_at_once(tiny_model):
    deaths: list[EngineDead] = []
    runner = EngineProcess(engine_factory(tiny_model), AutoTokenizer.from_pretrained(tiny_model),
                           on_death=deaths.append)
    try:
        [long] = requests(1, max_new_tokens=900)
        future = runner.submit(long)
        time.sleep(0.2)
        killed = time.monotonic()
        os.kill(runner.pid, signal.SIGKILL)
        with pytest.raises(EngineDead, match="exit code -9"):
            future.result(10)
        assert time.monotonic() - killed < 2
        while not deaths and time.monotonic() - killed < 2:  # called right after the futures fail
            time.sleep(0.01)
        assert len(deaths) == 1 and not runner.alive
        with pytest.raises(EngineDead):
            runner.submit(requests(1)[0])
    finally:
        runner.close()


def test_a_loop_that_crashes_taking_a_request_in_fails_it_instead_of_losing_it(tiny_model):
    thread = EngineThread(CrashOnAdd())
    with pytest.raises(EngineDead, match="a bug in add_request"):
        thread.submit(requests(1)[0]).result(10)
    assert not thread.alive
    runner = EngineProcess(crash_on_add_factory, AutoTokenizer.from_pretrained(tiny_model))
    try:
        # the engine process ends itself (its state is unknown), saying why
        with pytest.raises(EngineDead, match=r"a bug in add_request.*\(exit code 3\)"):
            runner.submit(requests(1)[0]).result(10)
        assert not runner.alive
    finally:
        runner.close()


def test_an_engine_that_cannot_load_says_why(tiny_model):
    with pytest.raises(RuntimeError, match="no such weights"):
        EngineProcess(broken_factory, AutoTokenizer.from_pretrained(tiny_model))


PARENT = """
import sys, time
from transformers import AutoTokenizer
from engine.runtime.engine_process import EngineProcess
from tests.test_engine_process import engine_factory
if __name__ == "__main__":
    runner = EngineProcess(engine_factory(sys.argv[1]), AutoTokenizer.from_pretrained(sys.argv[1]))
    print(runner.pid, flush=True)
    time.sleep(600)
"""


def test_the_engine_process_ends_when_its_worker_is_killed(tiny_model, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), str(tiny_model)], stdout=subprocess.PIPE, text=True,
                              cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    child = int(parent.stdout.readline())  # once its engine is loaded
    parent.kill()  # SIGKILL: no clean-up runs in the parent
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose: it runs nothing, and whoever inherited it reaps it when it will
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False
