"""Tensor parallelism on the CPU (gloo): the ranks' greedy output is token-identical to one rank's and to
transformers', through chunked prefill, pre-emption, prefix reuse with the host tier, and sliding windows; a
model the ranks cannot split is refused with its numbers; a step that fails on another rank is bisected by rank 0
as a one-rank engine's is; a rank that dies ends the worker and its jobs run again, and a step that meets the
dead rank is the engine's death, not a request's error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from api.http.client import Client
from cli.stack import Stack
from engine.interface import EngineStats, Request
from engine.llm_engine import LLMEngine
from engine.tensor_parallel import RANK_DIED
from jobs.schemas import JobIn
from tests.api_keys import API_KEY
from tests.engine_helpers import (
    greedy,
    kv_block_bytes,
    make_engine,
    prompts,
    run_all,
    transformers_greedy,
)
from tests.test_faults import FAST_RECOVERY, clean, job

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = prompts(12, 5, 300, seed=5)
NEW_TOKENS = [4 + i % 11 for i in range(len(PROMPTS))]


def requests() -> list[Request]:
    return [Request(str(i), ids, greedy(n, ignore_eos=False)) for i, (ids, n) in enumerate(zip(PROMPTS, NEW_TOKENS,
                                                                                             strict=True))]


def outputs(engine: LLMEngine, batch: list[Request]) -> list[list[int]]:
    try:
        done = run_all(engine, batch)
    finally:
        engine.close()
    return [done[r.request_id].token_ids for r in batch]


@pytest.mark.parametrize(("preset", "ranks"), [("tiny", 2), ("tiny-untied", 2), ("tiny-untied", 4), ("tiny-swa", 2)],
                         ids=["2-kv-heads", "4-kv-heads", "4-ranks-4-kv-heads", "window-1-kv-head-replicated"])
@pytest.mark.parametrize("pressure", [False, True], ids=["roomy", "preempting"])
def test_ranks_give_one_ranks_tokens_and_transformers(tiny_models, preset, ranks, pressure):
    path = tiny_models[preset]

    def tight(world: int) -> dict:
        """40 blocks of 16 tokens (each rank's shard of them) for ~3k tokens of work, 64-token prefill chunks, 96
        tokens a step"""
        if not pressure:
            return {}
        return dict(kv_cache_memory=40 * rank_block_bytes(path, world), initial_blocks=8, max_num_batched_tokens=96,
                    prefill_chunk_size=64, max_num_seqs=32)

    engine = make_engine(path, tensor_parallel=ranks, **tight(ranks))
    split = outputs(engine, requests())
    assert engine.stats().preemptions > 0 or not pressure
    assert split == outputs(make_engine(path, **tight(1)), requests()) == transformers_greedy(path, PROMPTS, NEW_TOKENS)


def rank_block_bytes(path: Path, world: int) -> int:
    """A KV block's bytes on one of `world` ranks (its KV heads' share, at least one head)."""
    heads = json.loads((path / "config.json").read_text())["num_key_value_heads"]
    return kv_block_bytes(path) * max(1, heads // world) // heads


def test_prefix_reuse_and_the_host_tier_work_on_every_rank(tiny_model):
    """Conversations whose earlier turns were evicted to the host tier and copied back: each rank repeats the
    copies on its shard of the pool, and the answers stay one rank's."""
    def tight(world: int) -> dict:
        return dict(kv_cache_memory=24 * rank_block_bytes(tiny_model, world), initial_blocks=8, max_num_seqs=8,
                    max_num_batched_tokens=256)

    first = [Request(f"a{i}", ids, greedy(6, ignore_eos=False)) for i, ids in enumerate(prompts(6, 64, 90, seed=8))]
    crowd = [Request(f"b{i}", ids, greedy(6, ignore_eos=False)) for i, ids in enumerate(prompts(6, 64, 90, seed=9))]
    # each first-turn conversation again, with its answer and a new question: its prefix was evicted meanwhile
    def again(done):
        return [Request(f"c{i}", r.prompt_ids + done[r.request_id].token_ids + [7, 8, 9], greedy(6, ignore_eos=False))
                for i, r in enumerate(first)]

    def turns(engine: LLMEngine) -> tuple[list[list[int]], EngineStats]:
        try:
            done = run_all(engine, first)
            done |= run_all(engine, crowd)
            done |= run_all(engine, again(done))
            return [done[k].token_ids for k in sorted(done)], engine.stats()
        finally:
            engine.close()

    split, stats = turns(make_engine(tiny_model, tensor_parallel=2, **tight(2)))
    alone, _ = turns(make_engine(tiny_model, **tight(1)))
    assert split == alone
    assert stats.host_hit_tokens > 0 and stats.evictions > 0


def test_a_model_the_ranks_cannot_split_is_refused_by_its_numbers(tiny_models):
    with pytest.raises(ValueError, match="tensor_parallel=3 does not divide its 8 attention heads, its 2 KV heads"):
        make_engine(tiny_models["tiny"], tensor_parallel=3)
    with pytest.raises(ValueError, match="tensor_parallel must be at least 1"):
        make_engine(tiny_models["tiny"], tensor_parallel=0)


def rank_processes(ancestor: int) -> list[int]:
    """The tensor-parallel rank processes among `ancestor`'s descendants."""
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        parents[int(pid)] = (int(stat.rsplit(")", 1)[1].split()[1]), b"engine.tensor_parallel" in cmdline)

    def descends(pid: int) -> bool:
        while pid in parents and pid != ancestor:
            pid = parents[pid][0]
        return pid == ancestor

    return [pid for pid, (_, is_rank) in parents.items() if is_rank and descends(pid)]


def test_a_rank_that_dies_ends_the_worker_and_its_jobs_run_again(service_env, database, tmp_path):
    env = {**service_env, **FAST_RECOVERY, "CONVOQ_TENSOR_PARALLEL": "2"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        with Client(stack.api_url, API_KEY) as client:
            ids = [client.submit(JobIn(messages=job(i).messages, sampling={"max_new_tokens": 400})).id
                   for i in range(4)]
            worker = stack.start_worker()
            deadline = time.monotonic() + 120
            while not (ranks := rank_processes(worker.pid)) or client.get(ids[0]).status != "running":
                assert time.monotonic() < deadline, "no job ran on the tensor-parallel engine"
                time.sleep(0.2)
            os.kill(ranks[0], signal.SIGKILL)
            assert worker.wait(60) == 3  # its engine died: it exits for its supervisor to restart it
            stack.env["CONVOQ_TENSOR_PARALLEL"] = "1"
            stack.start_worker()
            done = [client.wait(i, timeout=180) for i in ids]
    assert [j.status for j in done] == ["succeeded"] * 4
    clean(database, ids)


def test_a_rank_that_dies_while_the_ranks_meet_ends_rank_0_instead_of_leaving_it_waiting(tiny_model):
    """The rank is killed as soon as it is started, before it joins the group rank 0 waits on."""
    script = f"""
import os, signal, subprocess
import engine.tensor_parallel as tp
start = subprocess.Popen
def started_and_killed(*args, **kwargs):
    process = start(*args, **kwargs)
    os.kill(process.pid, signal.SIGKILL)
    return process
tp.subprocess.Popen = started_and_killed
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
LLMEngine(EngineConfig(model={str(tiny_model)!r}, tensor_parallel=2))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == RANK_DIED, out.stderr[-2000:]
    assert "the engine ends with it" in out.stderr


def test_a_rank_whose_rank_0_ends_without_a_stop_ends_quietly(tiny_model):
    """Rank 0's process exits with its engine never closed (no stop sent): the other rank ends, and says why
    rather than dying on the broken connection."""
    script = f"""
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
LLMEngine(EngineConfig(model={str(tiny_model)!r}, tensor_parallel=2))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    # `run` returns once every holder of the stderr pipe closed it: rank 1, which inherited it, has ended too
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rank 1 ends" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


# A stand-in for rank 0's process: it starts a rank's watch on itself, waits until that is running, and exits.
PARENT_THAT_EXITS = '''
import subprocess, sys
watch = """
import logging, os
from engine.tensor_parallel import _exit_with
logging.basicConfig(level=logging.INFO)
print("watching", flush=True)
_exit_with(os.getppid(), 1)
"""
child = subprocess.Popen([sys.executable, "-c", watch], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "watching\\n"
'''


def test_a_rank_that_sees_rank_0s_process_gone_before_its_connection_breaks_says_why_it_ends():
    """A rank's watch on its parent can end it before a collective fails (or while it still builds): it says so
    too, rather than vanishing without a word."""
    out = run_script(PARENT_THAT_EXITS)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rank 1 ends" in out.stderr, out.stderr[-2000:]


def run_script(script: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                          cwd=Path(__file__).resolve().parent.parent, env=env)


# Rank 1 alone fails every step that holds the request `poison`, after its collectives (rank 0 is not kept
# waiting in one): loaded into rank 1's process, which is `python -m engine.tensor_parallel --rank 1 ...`.
POISONED_RANK = """
import sys
if "engine.tensor_parallel" in sys.orig_argv:
    from engine.model.step_executor import StepExecutor
    logits = StepExecutor.logits
    def poisoned(self, plan):
        out = logits(self, plan)
        if "poison" in plan.request_ids:
            raise ValueError("rank 1 cannot run this request")
        return out
    StepExecutor.logits = poisoned
"""


def test_a_step_that_fails_on_another_rank_is_bisected_by_rank_0(tiny_model, tmp_path):
    """The failing rank says so instead of exiting (and taking the worker with it): rank 0's engine thread finds the
    request by bisection, and the others finish with one rank's tokens."""
    (tmp_path / "sitecustomize.py").write_text(POISONED_RANK)
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])}
    script = f"""
import json
from engine.interface import Request
from engine.runtime.engine_thread import EngineThread
from tests.engine_helpers import greedy, make_engine, prompts
batch = [Request(r, ids, greedy(6)) for r, ids in zip(["a", "b", "poison", "c", "d"], prompts(5, 5, 40, seed=2))]
outputs = []
for ranks in (2, 1):
    thread = EngineThread(make_engine({str(tiny_model)!r}, tensor_parallel=ranks))
    futures = [thread.submit(r) for r in batch]
    outputs.append({{r.request_id: [f.result(120).finish_reason, f.result().token_ids, f.result().retryable]
                    for r, f in zip(batch, futures)}})
    thread.close()
print(json.dumps(outputs))
"""
    out = run_script(script, env)
    assert out.returncode == 0, out.stderr[-3000:]
    split, alone = json.loads(out.stdout.splitlines()[-1])
    assert split["poison"][0] == "error" and split["poison"][2]  # alone it failed: retryable, as any engine error
    assert {k: v for k, v in split.items() if k != "poison"} == {k: v for k, v in alone.items() if k != "poison"}
    assert "rank 1: a step failed; rank 0 bisects its batch" in out.stderr


def test_a_step_that_meets_a_dead_rank_is_the_engines_death_not_a_requests_error(tiny_model):
    """Rank 0's watcher is slowed here, so that the step meets the dead rank first: its collective's error ends
    the engine thread (`RankLost`, fatal) and fails the request with `EngineDead`, never an error charged to it."""
    script = f"""
import os, signal, time
import engine.tensor_parallel as tp
tp.WATCH_EVERY_S = 3600
from engine.interface import EngineDead, Request
from engine.runtime.engine_thread import EngineThread
from tests.engine_helpers import greedy, make_engine
engine = make_engine({str(tiny_model)!r}, tensor_parallel=2)
[rank] = engine.ranks.processes
os.kill(rank.pid, signal.SIGKILL)
rank.wait()
thread = EngineThread(engine)
try:
    done = thread.submit(Request("r", [5, 6, 7], greedy(4))).result(60)
    print("completed", done.finish_reason, done.error)
except EngineDead as exc:
    print("dead", type(thread.error).__name__)
os._exit(0)
"""
    out = run_script(script)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["dead", "RankLost"], out.stdout + out.stderr[-3000:]
