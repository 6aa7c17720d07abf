"""An engine that stops making progress, and a step that fails, never hold the rest up: a watchdog kills a frozen or
stuck engine process and starts a new one (an idle engine is left alone), tells the owner of a stuck engine
thread, and a failing step is bisected while the loop goes on taking new work, cancels and deadlines."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from engine.interface import Completion, EngineStalled, EngineStats, Request, SamplingParams
from engine.runtime.engine_process import EngineProcess
from engine.runtime.engine_thread import EngineThread
from tests.test_engine_process import _alive

HANG, POISON = 1, 2  # a step holding a request whose prompt starts with HANG never ends; with POISON, it raises
STEP_S = 0.01
release = threading.Event()  # ends the hung steps of a thread engine, so that the test can close it


class Counting:
    """A model-free engine: a request makes one token per step until it has `max_new_tokens`."""

    tokenizer = None
    max_model_len = 1024

    def __init__(self) -> None:
        self.running: dict[str, tuple[Request, list[int]]] = {}
        self.failures = 0

    def add_request(self, request: Request) -> None:
        self.running[request.request_id] = (request, [])

    def abort_request(self, request_id: str) -> Completion | None:
        entry = self.running.pop(request_id, None)
        return None if entry is None else Completion(request_id, entry[1], "", len(entry[0].prompt_ids), "cancelled")

    def partial(self, request_id: str, at_least: int) -> list[int] | None:
        entry = self.running.get(request_id)
        return None if entry is None or len(entry[1]) < at_least else list(entry[1])

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list[Completion]:
        time.sleep(STEP_S)
        firsts = {request.prompt_ids[0] for request, _ in self.running.values()}
        if HANG in firsts:
            release.wait()
        if POISON in firsts:
            self.failures += 1
            raise ValueError("a poisoned batch")
        done = []
        for request_id, (request, out) in list(self.running.items()):
            out.append(7)
            if len(out) >= request.sampling.max_new_tokens:
                del self.running[request_id]
                done.append(Completion(request_id, list(out), "", len(request.prompt_ids), "length"))
        return done

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self.running))


def counting() -> Counting:
    return Counting()


def request(request_id: str, tokens: int, first: int = 5, deadline: float | None = None) -> Request:
    return Request(request_id, [first, 3, 4], SamplingParams(max_new_tokens=tokens), deadline=deadline)


def test_a_frozen_engine_process_is_killed_and_a_new_one_takes_over_while_an_idle_one_is_left_alone():
    deaths: list = []
    runner = EngineProcess(counting, None, on_death=deaths.append, stall_s=2)
    try:
        first = runner.pid
        assert runner.submit(request("warm", 3)).result(10).finish_reason == "length"
        time.sleep(3)  # idle for longer than the limit: not a stall
        assert runner.pid == first and runner.restarts == 0
        long = runner.submit(request("long", 100_000))
        time.sleep(0.3)
        os.kill(first, signal.SIGSTOP)  # no beats at all from here on
        stopped = time.monotonic()
        with pytest.raises(EngineStalled):
            long.result(15)
        assert 2 <= time.monotonic() - stopped < 5
        assert runner.submit(request("after", 3)).result(30).finish_reason == "length"  # on the new engine
        assert runner.pid != first and runner.restarts == 1 and runner.alive and not deaths
        assert runner.stats().restarts == 1  # for `convoq_engine_restarts_total`
        time.sleep(0.5)
        assert not _alive(first)
    finally:
        runner.close()


def counting_slow_to_reload(marker: str) -> Counting:
    """`Counting`, whose every load after the first takes seconds, as a model's reload does."""
    if Path(marker).exists():
        time.sleep(6)
    Path(marker).touch()
    return Counting()


def test_what_is_submitted_while_a_stalled_engine_reloads_waits_for_it_but_a_cancel_or_deadline_does_not(tmp_path):
    runner = EngineProcess(functools.partial(counting_slow_to_reload, str(tmp_path / "loaded")), None, stall_s=1)
    try:
        long = runner.submit(request("long", 100_000))
        time.sleep(0.3)
        os.kill(runner.pid, signal.SIGSTOP)
        with pytest.raises(EngineStalled):
            long.result(15)
        # the new engine takes seconds to load: a submit meanwhile returns at once, and its cancel ends it at once
        started = time.monotonic()
        cancelled = runner.submit(request("cancelled", 3))
        expiring = runner.submit(request("expiring", 3, deadline=time.monotonic() + 0.5))
        waiting = runner.submit(request("waiting", 3))
        assert time.monotonic() - started < 1
        runner.cancel("cancelled")
        assert cancelled.result(1).finish_reason == "cancelled" and not waiting.done()
        # the others go in once it is up: one whose deadline passed meanwhile ends so, the other runs
        assert waiting.result(30).finish_reason == "length" and expiring.result(1).finish_reason == "expired"
        assert runner.restarts == 1 and time.monotonic() - started > 3
    finally:
        runner.close()


def test_a_loop_stuck_in_one_step_is_a_stall_though_its_process_still_beats():
    runner = EngineProcess(counting, None, stall_s=2)
    try:
        first = runner.pid
        beside = runner.submit(request("beside", 100_000))
        time.sleep(0.3)
        stuck = runner.submit(request("stuck", 5, first=HANG))
        started = time.monotonic()
        for future in (stuck, beside):  # both were in the engine when it stalled
            with pytest.raises(EngineStalled):
                future.result(15)
        assert 2 <= time.monotonic() - started < 5
        assert runner.submit(request("after", 3)).result(30).finish_reason == "length"
        assert runner.pid != first and runner.restarts == 1
    finally:
        runner.close()


def test_a_stuck_engine_thread_is_reported_to_its_owner_and_an_idle_one_is_not():
    release.clear()
    stalls: list[EngineStalled] = []
    thread = EngineThread(Counting(), stall_s=1, on_stall=stalls.append)
    try:
        assert thread.submit(request("warm", 3)).result(10).finish_reason == "length"
        time.sleep(2)
        assert stalls == []
        thread.submit(request("stuck", 5, first=HANG))
        started = time.monotonic()
        while not stalls and time.monotonic() - started < 5:
            time.sleep(0.05)
        assert len(stalls) == 1 and isinstance(stalls[0], EngineStalled)
        assert 1 <= time.monotonic() - started < 3
    finally:
        release.set()
        thread.close()


def test_a_failing_step_is_bisected_while_new_work_cancels_and_deadlines_go_on():
    engine = Counting()
    thread = EngineThread(engine)
    try:
        futures = {f"r{i}": thread.submit(request(f"r{i}", 150, first=POISON if i == 1 else 5,
                                                  deadline=time.monotonic() + 1.5 if i == 7 else None))
                   for i in range(8)}
        deadline = time.monotonic() + 60
        while engine.failures == 0:
            assert time.monotonic() < deadline, "the poisoned step never ran"
            time.sleep(0.005)
        # the suspects are being sorted out: the loop still takes new work and stops what it is asked to
        fresh = thread.submit(request("fresh", 5))
        assert fresh.result(timeout=3).finish_reason == "length"
        asked = time.monotonic()
        thread.cancel("r6")
        cancelled = futures.pop("r6").result(timeout=1)
        assert cancelled.finish_reason == "cancelled" and time.monotonic() - asked < 0.5
        expired = futures.pop("r7").result(timeout=2)
        assert expired.finish_reason == "expired"
        # one bad request never sinks its batch: only the poisoned one fails, alone, and may be retried
        bad = futures.pop("r1").result(timeout=60)
        assert bad.finish_reason == "error" and bad.retryable and "alone" in bad.error
        for future in futures.values():
            done = future.result(timeout=60)
            assert done.finish_reason == "length" and len(done.token_ids) == 150
        assert engine.failures >= 2 and not engine.running
    finally:
        thread.close()


def test_a_watchdog_frozen_with_its_worker_judges_nothing_until_the_engine_has_had_its_turns(monkeypatch):
    """SIGSTOP of the whole worker (or a paused VM): on waking, the watchdog's last reading predates the freeze;
    it must not call the engine stalled before the engine has been read again."""
    from engine.runtime import watchdog

    offset = [0.0]
    real = time.monotonic
    monkeypatch.setattr(watchdog, "time", type("Clock", (), {"monotonic": staticmethod(lambda: real() + offset[0])}))
    stalls: list[str] = []
    dog = watchdog.Watchdog(0.8, lambda: True, stalls.append, sample=lambda: (7, True))
    try:
        time.sleep(0.3)
        offset[0] = 60.0  # the process was frozen for a minute: no tick ran meanwhile
        time.sleep(0.5)  # under the stall time since waking
        assert stalls == []
        time.sleep(1.0)  # the loop still does not turn once awake: now that is a stall
        assert len(stalls) >= 1
    finally:
        dog.close()
