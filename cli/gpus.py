"""`convoq worker --gpus all|0,1,...`: one worker process per GPU of a host (per group of N GPUs with
`CONVOQ_TENSOR_PARALLEL=N`), each pinned to its GPUs.

Each worker is a process of its own (`convoq worker` without `--gpus`), started with `CUDA_VISIBLE_DEVICES` set
to its GPU (or its group's, in order: its tensor-parallel rank r takes the r-th), so that its engine's `cuda` is
that GPU and nothing else on the host; it has its own Celery node
name (`convoq-<pid>@<host>`) and its own metrics port (`CONVOQ_WORKER_METRICS_PORT` plus its index). This
process supervises them: a worker that exits (its engine died) is started again after a pause, and a SIGTERM or
SIGINT is passed on to every worker, whose warm shutdown then runs as it would alone; it exits when they have.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)
RESTART_AFTER_S = 5.0  # a worker that exited is started again after this long (its GPU may need a moment)


def gpu_list(spec: str, count: Callable[[], int]) -> list[str]:
    """The GPUs `--gpus` names: `all` (`count()` of them) or a comma-separated list of ids, each once."""
    if spec.strip() == "all":
        ids = [str(i) for i in range(count())]
        if not ids:
            raise ValueError("--gpus all: no GPU is visible here (CUDA_VISIBLE_DEVICES, `nvidia-smi`)")
        return ids
    ids = [part.strip() for part in spec.split(",")]
    if any(not part for part in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"--gpus {spec!r}: give `all` or distinct GPU ids separated by commas, e.g. 0,1,2,3")
    return ids


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


@dataclass
class Placement:
    gpu: str  # CUDA_VISIBLE_DEVICES of the worker: one id, or its tensor-parallel group's, comma-separated
    metrics_port: int  # 0: not served


def placements(gpus: list[str], metrics_port: int, per_worker: int = 1) -> list[Placement]:
    """One worker per `per_worker` GPUs (its tensor-parallel group, in the order given), each with its own
    metrics port (none when the base port is 0)."""
    if len(gpus) % per_worker:
        raise ValueError(f"--gpus names {len(gpus)} GPUs, which CONVOQ_TENSOR_PARALLEL={per_worker} does not split "
                         f"into groups of {per_worker}")
    groups = [",".join(gpus[i:i + per_worker]) for i in range(0, len(gpus), per_worker)]
    return [Placement(group, metrics_port + i if metrics_port else 0) for i, group in enumerate(groups)]


class Supervisor:
    """The workers of `placements`, each `convoq worker` with `args`, kept running until a signal stops them."""

    def __init__(self, placements: list[Placement], args: list[str]) -> None:
        self.placements, self.args = placements, args
        self.procs: list[subprocess.Popen | None] = [None] * len(placements)
        self.stopping = threading.Event()

    def spawn(self, i: int) -> None:
        if self.stopping.is_set():  # a worker started after the signal would never get it
            return
        place = self.placements[i]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": place.gpu, "CONVOQ_WORKER_METRICS_PORT": str(place.metrics_port)}
        # a session of its own: a terminal's Ctrl-C reaches the workers once, through `stop`, not twice (a second
        # SIGINT is Celery's cold shutdown)
        self.procs[i] = subprocess.Popen([sys.executable, "-m", "cli.main", "worker", *self.args], env=env,
                                         start_new_session=True)
        log.info("worker %d on GPU %s: pid %d, metrics port %d", i, place.gpu, self.procs[i].pid, place.metrics_port)

    def stop(self, signum: int, _frame: object = None) -> None:
        self.stopping.set()
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signum)

    def run(self) -> int:
        """Until a signal: restart any worker that exits; then wait for every worker. Returns an exit code."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.stop)
        for i in range(len(self.placements)):
            self.spawn(i)
        exited: dict[int, float] = {}  # worker index -> when it was seen gone
        while not self.stopping.wait(0.5):
            now = time.monotonic()
            for i, proc in enumerate(self.procs):
                if proc.poll() is not None and i not in exited:
                    log.warning("worker %d on GPU %s exited (%s); starting it again in %.0f s", i,
                                self.placements[i].gpu, proc.returncode, RESTART_AFTER_S)
                    exited[i] = now
                elif i in exited and now - exited[i] >= RESTART_AFTER_S:
                    del exited[i]
                    self.spawn(i)
        codes = [proc.wait() for proc in self.procs]
        return 0 if all(code in (0, -signal.SIGTERM, -signal.SIGINT) for code in codes) else 1
