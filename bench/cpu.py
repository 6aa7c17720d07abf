"""CPU time each part of a run spends (the API, the worker, its engine, PostgreSQL, Redis, the benchmark's own
client), read from /proc: where the cost of a job goes when all of them share one machine's cores.

Linux only: where there is no /proc there is nothing to read, and `CpuMeter.stop` returns no parts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from worker.usage import process_cpu_s, stat_fields

PROC = Path("/proc")


@dataclass(frozen=True)
class Proc:
    pid: int
    name: str
    session: int
    cpu_s: float  # user + system, all threads


def processes() -> dict[int, Proc]:
    """Every process readable now (one that ends while being read is left out)."""
    found = {}
    for entry in PROC.glob("[0-9]*") if PROC.is_dir() else ():
        pid = int(entry.name)
        if (stat := stat_fields(pid)) is not None:
            name, fields = stat
            found[pid] = Proc(pid, name, int(fields[3]), process_cpu_s(fields))
    return found


def service_parts(api_pid: int, worker_pid: int) -> dict[str, Callable[[Proc], bool]]:
    """The parts of a `cli.stack.Stack` run: its processes start sessions of their own, so the engine process
    is the one in the worker's session that is not the worker."""
    return {
        "api": lambda p: p.session == api_pid,
        "worker": lambda p: p.pid == worker_pid,
        "engine": lambda p: p.session == worker_pid and p.pid != worker_pid,
        **shared_parts(),
    }


def shared_parts() -> dict[str, Callable[[Proc], bool]]:
    """The parts every run has: the database, the broker and this benchmark process (the client)."""
    me = os.getpid()
    return {
        "postgres": lambda p: p.name == "postgres",
        "redis": lambda p: p.name.startswith("redis-server"),
        "client": lambda p: p.pid == me,
    }


class CpuMeter:
    """CPU seconds each part spends between `start` and `stop`. A process counts for the first part it
    matches; processes that ended meanwhile are lost (a part should outlive the measurement)."""

    def __init__(self, parts: dict[str, Callable[[Proc], bool]]) -> None:
        self.parts = parts
        self.before: dict[int, Proc] = {}

    def start(self) -> None:
        self.before = processes()

    def stop(self) -> dict[str, float]:
        spent = dict.fromkeys(self.parts, 0.0)
        for pid, proc in processes().items():
            part = next((name for name, matches in self.parts.items() if matches(proc)), None)
            if part is not None:
                earlier = self.before.get(pid)
                spent[part] += proc.cpu_s - (earlier.cpu_s if earlier is not None else 0.0)
        return spent if self.before else {}


def per_item_ms(spent: dict[str, float], n: int) -> dict[str, float]:
    """CPU ms per item (job or task) of each part, and their sum as `total`."""
    ms = {name: round(s * 1e3 / n, 2) for name, s in spent.items()}
    return {**ms, "total": round(sum(spent.values()) * 1e3 / n, 2)} if ms else {}
