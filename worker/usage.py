"""What a worker has used over its life, for its row in `workers` (the report's CPU per job): the CPU time of
its own process, of its engine process (read from /proc where there is one) and of the engine processes it
already replaced (restarted after a stall, and reaped)."""

from __future__ import annotations

import os
from pathlib import Path

TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def stat_fields(pid: int) -> tuple[str, list[str]] | None:
    """The name of process `pid` and the fields of its /proc stat after the name, numbered from 3 (state); None
    where there is no such process or no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the name is in parentheses and may hold spaces
    return stat[stat.index("(") + 1: stat.rindex(")")], stat[stat.rindex(")") + 2:].split()


def process_cpu_s(fields: list[str]) -> float:
    """User and system CPU seconds, all threads, of a process's `stat_fields`."""
    return (int(fields[11]) + int(fields[12])) * TICK_S


def cpu_seconds(engine_pid: int | None) -> float:
    """CPU seconds of this process, of the children it reaped, and of the engine process `engine_pid`."""
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    found = stat_fields(engine_pid) if engine_pid is not None else None
    return own + (process_cpu_s(found[1]) if found is not None else 0.0)
