"""`convoq worker --gpus all|0,1,...`: one worker process per GPU of a host (per group of N GPUs with
`CONVOQ_TENSOR_PARALLEL=N`), each pinned to its GPUs.

Each worker is a process of its own (`convoq worker` without `--gpus`), started with `CUDA_VISIBLE_DEVICES` set
to its GPU (or its group's, in order: its tensor-parallel rank r takes the r-th), so that its engine's `cuda` is
that GPU and nothing else on the host; it has its own Celery node
name (`convoq-<pid>@<host>`) and its own metrics port (`CONVOQ_WORKER_METRICS_PORT` plus its index). This
process supervises them: a worker that exits (its engine died, or it could not start) is started again after a
pause that doubles at each exit in a row (`RESTART_AFTER_S` up to `RESTART_MAX_S`; a worker that had run
`STEADY_S` starts from the first pause again), with a line saying why it exited (`worker.exits`); a SIGTERM or
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

from worker.exits import why

log = logging.getLogger(__name__)
RESTART_AFTER_S = 5.0  # a worker that exited is started again after this long (its GPU may need a moment)
# A worker that cannot start (a bad model, the database away) would otherwise be started again every few seconds,
# loading its model each time, for as long as the fault lasts; one that ran this long had recovered
RESTART_MAX_S = 300.0
STEADY_S = 600.0
POLL_S = 0.5  # how often the workers are looked at
WORKER = [sys.executable, "-m", "cli.main", "worker"]


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


def restart_delay(exits_in_a_row: int, first_s: float = RESTART_AFTER_S, most_s: float = RESTART_MAX_S) -> float:
    """How long a worker waits before its next start, after its `exits_in_a_row`-th exit in a row (1, 2, ...)."""
    return min(most_s, first_s * 2 ** (exits_in_a_row - 1))


class Supervisor:
    """The workers of `placements`, each `command` (`convoq worker`) with `args`, kept running until a signal
    stops them."""

    def __init__(self, placements: list[Placement], args: list[str], command: list[str] = WORKER,
                 first_delay_s: float = RESTART_AFTER_S) -> None:
        self.placements, self.args, self.command, self.first_delay_s = placements, args, command, first_delay_s
        self.procs: list[subprocess.Popen | None] = [None] * len(placements)
        self.started: list[float] = [0.0] * len(placements)  # monotonic, each worker's latest start
        self.stopping = threading.Event()

    def spawn(self, i: int) -> None:
        if self.stopping.is_set():  # a worker started after the signal would never get it
            return
        place = self.placements[i]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": place.gpu, "CONVOQ_WORKER_METRICS_PORT": str(place.metrics_port)}
        # a session of its own: a terminal's Ctrl-C reaches the workers once, through `stop`, not twice (a second
        # SIGINT is Celery's cold shutdown)
        self.procs[i] = subprocess.Popen([*self.command, *self.args], env=env, start_new_session=True)
        self.started[i] = time.monotonic()
        log.info("worker %d on GPU %s: pid %d, metrics port %d", i, place.gpu, self.procs[i].pid, place.metrics_port)

    def stop(self, signum: int, _frame: object = None) -> None:
        self.stopping.set()
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signum)

    def run(self) -> int:
        """Until a signal: restart any worker that exits, after its backoff; then wait for every worker. Returns an
        exit code."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.stop)
        for i in range(len(self.placements)):
            self.spawn(i)
        due: dict[int, float] = {}  # worker index -> when it starts again
        in_a_row = [0] * len(self.placements)  # exits of each worker with no steady run between
        while not self.stopping.wait(POLL_S):
            now = time.monotonic()
            for i, proc in enumerate(self.procs):
                if proc.poll() is not None and i not in due:
                    in_a_row[i] = 1 if now - self.started[i] >= STEADY_S else in_a_row[i] + 1
                    delay = restart_delay(in_a_row[i], self.first_delay_s)
                    log.warning("worker %d on GPU %s exited: %s (exit %s, %d in a row); starting it again in %.1f s",
                                i, self.placements[i].gpu, why(proc.returncode), proc.returncode, in_a_row[i], delay)
                    due[i] = now + delay
                elif i in due and now >= due[i]:
                    del due[i]
                    self.spawn(i)
        codes = [proc.wait() for proc in self.procs]
        return 0 if all(code in (0, -signal.SIGTERM, -signal.SIGINT) for code in codes) else 1
