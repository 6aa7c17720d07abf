"""Tensor parallelism on the CPU (gloo): the ranks' greedy output is token-identical to one rank's and to
transformers', through chunked prefill, pre-emption, prefix reuse with the host tier, and sliding windows; a
model the ranks cannot split is refused with its numbers; a rank that dies ends the worker and its jobs run again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from api.client import Client
from cli.stack import Stack
from engine.interface import Request
from engine.llm_engine import LLMEngine
from engine.tensor_parallel import RANK_DIED
from jobs.schemas import JobIn
from tests.conftest import API_KEY
from tests.engine_helpers import (  # noqa: F401 (single_thread: autouse)
    greedy,
    kv_block_bytes,
    make_engine,
    prompts,
    run_all,
    single_thread,
    transformers_greedy,
)
from tests.test_faults import FAST_RECOVERY, clean, job

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
    assert engine.stats()["preemptions"] > 0 or not pressure
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

    def turns(engine: LLMEngine) -> tuple[list[list[int]], dict]:
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
    assert stats["host_hit_tokens"] > 0 and stats["evictions"] > 0


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
