"""A tensor-parallel engine's ranks as processes: rank 0 is the engine, ranks 1..N-1 follow its steps.

`CONVOQ_TENSOR_PARALLEL=N` (`EngineConfig.tensor_parallel`) splits the model over N devices
(engine.model.parallel). The process that builds the `LLMEngine` is rank 0: it starts the others as
`python -m engine.tensor_parallel` processes, and all N join one `torch.distributed` group (NCCL on CUDA, gloo
on the CPU), then build their parts in step. Only rank 0 schedules and samples. Before each step it sends the
others, over a gloo group, a `Step`: the plan (engine.step, without its sampling inputs), each KV pool's size
(a pool grows between steps: each rank grows its shard to match) and the host tier's copies since the last
step (the prefix cache's evictions and returns, which each rank repeats on its shard, in order). Every rank then
runs the plan's forward: attention and MLP end in all-reduces, and the logits of the sampling rows are
gathered, so rank 0 samples from the whole vocabulary.

After each step every rank says whether its part failed (one all-reduce over the gloo group): a step that
failed on any rank fails on rank 0, whose engine thread bisects the batch as for a one-rank engine, while the
others wait for the next step. A rank whose step raised part way through its collectives leaves the others
waiting in one of them: the engine's watchdog sees the stall.

A rank that dies ends the engine: rank 0 watches the others and exits at once when one is gone (the worker
then sees its engine die, as for any engine crash), and each of the others exits when rank 0 is gone. A step
that meets a dead rank (a collective's error) raises `RankLost`, an engine's death, never a request's error.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.interface import EngineDead
from engine.model.families import read_shape
from engine.model.parallel import Split
from engine.model.shape import rank_shape
from engine.parts import EngineParts, build
from engine.runtime.engine_thread import is_fatal
from engine.step import StepPlan, StepResult

log = logging.getLogger(__name__)

# a rank waits for the next step however long the engine idles; a dead peer is noticed by the watchers instead
IDLE_FOREVER = timedelta(days=365)
WATCH_EVERY_S = 0.5
RANK_DIED = 70  # rank 0's exit code when another rank is gone


class RankLost(EngineDead):
    """A tensor-parallel rank is gone: the engine cannot run another step."""


class RankStepFailed(RuntimeError):
    """A step failed on another rank than this one (its log says why); the step fails here too, and is bisected."""


def agree_failed(group: dist.ProcessGroup, failed: bool) -> bool:
    """Whether a step failed on any rank, each rank saying whether it did on its own."""
    flag = torch.tensor([int(failed)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


@dataclass
class Step:
    """What the other ranks need to run one of rank 0's steps; `plan` None: stop."""

    plan: StepPlan | None
    pool_blocks: list[int]  # each KV pool's size: grown on rank 0 since the last step
    host_copies: list[tuple]  # the host tier's puts and loads since the last step, in order


def rank_device(config: EngineConfig, rank: int) -> EngineConfig:
    """`config` for `rank`: on CUDA its own device (the rank-th of those visible); on the CPU its share of the
    cores (each rank's own threads would otherwise contend for all of them)."""
    if not config.device.startswith("cuda"):
        torch.set_num_threads(min(torch.get_num_threads(), max(1, (os.cpu_count() or 1) // config.tensor_parallel)))
        return config
    torch.cuda.set_device(rank)
    return replace(config, device=f"cuda:{rank}")


def _join(config: EngineConfig, rank: int, world: int, address: str) -> dist.ProcessGroup:
    """Join the ranks' group; returns the gloo group steps are sent over (the same one on the CPU)."""
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world, timeout=IDLE_FOREVER)
    # NCCL sets up its communicator at the first collective, which must not be one a CUDA graph is capturing
    dist.all_reduce(torch.zeros(1, device=config.device))
    return dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=IDLE_FOREVER)


class Ranks:
    """Rank 0's side: the other ranks' processes, and the steps sent to them."""

    def __init__(self, config: EngineConfig) -> None:
        self.world = config.tensor_parallel
        rank_shape(read_shape(config.model), self.split)  # a model the ranks cannot split is refused before they start
        if torch.device(config.device).type == "cuda" and torch.cuda.device_count() < self.world:
            raise ValueError(f"tensor_parallel={self.world} needs {self.world} GPUs; "
                             f"{torch.cuda.device_count()} are visible")
        self.parts: EngineParts | None = None
        self.closing = False
        self.threads = torch.get_num_threads()  # this process's own, given back at close
        with socket.socket() as s:  # a free port for the group's rendezvous
            s.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        encoded = base64.b64encode(pickle.dumps(config)).decode()
        self.processes = [subprocess.Popen([sys.executable, "-m", "engine.tensor_parallel", "--rank", str(rank),
                                            "--world", str(self.world), "--address", address, "--config", encoded])
                          for rank in range(1, self.world)]
        # watched from before the rendezvous: a rank that dies while it starts would leave rank 0 waiting there
        threading.Thread(target=self._watch, name="tensor-parallel-watch", daemon=True).start()
        self.config = rank_device(config, 0)
        self.group = _join(self.config, 0, self.world, address)

    @property
    def split(self) -> Split:
        return Split(0, self.world)

    def attach(self, parts: EngineParts) -> None:
        """Rank 0's own parts, built: from now on the host tier's copies are recorded for the others."""
        self.parts = parts
        if parts.blocks.prefix is not None and parts.blocks.prefix.host is not None:
            parts.blocks.prefix.host.journal = []

    def send(self, plan: StepPlan | None) -> None:
        """Hand the others `plan` (None: stop), with what changed in the pools since the last one."""
        host = self.parts.blocks.prefix.host if self.parts.blocks.prefix is not None else None
        copies = []
        if host is not None:
            copies, host.journal = host.journal, []
        sizes = [pool.cache.num_blocks for pool in self.parts.blocks.pools]
        step = Step(replace(plan, sampling=None) if plan is not None else None, sizes, copies)
        dist.broadcast_object_list([step], src=0, group=self.group)

    def step(self, plan: StepPlan, run: Callable[[], StepResult]) -> StepResult:
        """Rank 0's step: `plan` sent to the others, `run` (its own part) run, then the ranks agree it went well.
        Raises what `run` raised, `RankStepFailed` when another rank's part failed, `RankLost` when a rank is gone."""
        with self._collectives():
            self.send(plan)
        try:
            result = run()
        except Exception as exc:
            if is_fatal(exc):
                raise
            self._check_ranks(exc)
            with self._collectives():
                agree_failed(self.group, True)
            raise
        with self._collectives():
            failed = agree_failed(self.group, False)
        if failed:
            raise RankStepFailed("the step failed on another tensor-parallel rank")
        return result

    @contextlib.contextmanager
    def _collectives(self):
        """A collective's error means a rank is gone (or their connection): the engine's death."""
        try:
            yield
        except RuntimeError as exc:
            raise RankLost(f"a tensor-parallel rank is gone: {str(exc).splitlines()[0]}") from exc

    def _check_ranks(self, exc: Exception) -> None:
        """Raise `RankLost` if `exc`, raised by rank 0's part of a step, came from a rank being gone: a collective's
        error, or a rank's process that has exited."""
        gone = [p.pid for p in self.processes if p.poll() is not None]
        if gone or isinstance(exc, dist.DistError):
            raise RankLost(f"a tensor-parallel rank is gone ({gone or 'its connection broke'}): {exc}") from exc

    def close(self) -> None:
        """Stop the other ranks: they are sent a stop once rank 0 has its parts, else (rank 0 failed to build)
        killed."""
        if self.closing:
            return
        self.closing = True
        if self.parts is not None:
            with contextlib.suppress(RuntimeError):  # a rank already gone
                self.send(None)
        else:
            for process in self.processes:
                process.kill()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self.threads)

    def _watch(self) -> None:
        while not self.closing:
            for process in self.processes:
                if process.poll() is not None and not self.closing:
                    log.error("tensor-parallel rank process %d exited with %s: the engine ends with it",
                              process.pid, process.returncode)
                    os._exit(RANK_DIED)
            time.sleep(WATCH_EVERY_S)


def follow(config: EngineConfig, rank: int, world: int, address: str) -> None:
    """A rank other than the first: join, build in step with rank 0, then run each step it sends."""
    config = rank_device(config, rank)
    group = _join(config, rank, world, address)
    parts = build(config, split=Split(rank, world))
    while True:
        received = [None]
        try:
            dist.broadcast_object_list(received, src=0, group=group)
            step: Step = received[0]
            if step.plan is None:
                break
            agree_failed(group, not _run_step(parts, step, rank))
        except RuntimeError as exc:  # rank 0's process ended without a stop (killed, or it exited): so does this one
            log.info("rank 0 is gone (%s); rank %d ends", str(exc).splitlines()[0], rank)
            return
    dist.destroy_process_group()


def _run_step(parts: EngineParts, step: Step, rank: int) -> bool:
    """This rank's part of one of rank 0's steps; False if it failed (not fatally: rank 0 bisects the batch, and
    this rank waits for the next step as after any other)."""
    try:
        for pool, blocks in zip(parts.blocks.pools, step.pool_blocks, strict=True):
            if pool.cache.num_blocks != blocks:
                pool.cache.resize(blocks)
        host = parts.blocks.prefix.host if parts.blocks.prefix is not None else None
        for name, entry, block in step.host_copies:
            getattr(host, name)(entry, block)
        parts.executor.logits(step.plan)
    except Exception as exc:
        if is_fatal(exc) or isinstance(exc, dist.DistError):
            raise
        log.exception("rank %d: a step failed; rank 0 bisects its batch", rank)
        return False
    return True


def _exit_with(parent: int, rank: int) -> None:
    """Exit this process once `parent` (rank 0's process) is gone: nothing would send it another step. It may
    notice before the broken connection does (or while this rank still builds), so it says why too."""
    while os.getppid() == parent:
        time.sleep(WATCH_EVERY_S)
    log.info("rank 0's process %d is gone; rank %d ends", parent, rank)
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description="a rank of a tensor-parallel engine (started by rank 0)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--config", required=True, help="the engine's config, pickled and base64-encoded")
    args = parser.parse_args()
    # like the engine process: a worker's shutdown signals reach its whole process group, and the ranks end
    # with rank 0, which ends when the worker says so
    for meant_for_the_worker in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):
        signal.signal(meant_for_the_worker, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"[%(asctime)s: %(levelname)s/rank-{args.rank}] %(message)s")
    threading.Thread(target=_exit_with, args=(os.getppid(), args.rank), daemon=True).start()
    follow(pickle.loads(base64.b64decode(args.config)), args.rank, args.world, args.address)


if __name__ == "__main__":
    main()
