"""CPU time of a worker's threads by what they do (`convoq_worker_thread_cpu_seconds_total{thread=...}`).

A busy worker is one process of a few hundred threads, and its CPU per job (`process_cpu_seconds_total`) does not
say which of them spends it: Celery's event loop (`MainThread`: receiving, acknowledging, task events), the
threads that run jobs (Celery's pool, `ThreadPoolExecutor`, and a group's lines, `line`), the database writers
(`claims`, `stores`), the pipe to the engine (`engine-outbox`, `engine-reader`), progress events, heartbeats and
sweeps. Threads are labelled by their name with its number left out, so a pool counts as one.

Read from /proc/self/task/<id>/schedstat: the kernel's own count of a thread's time on a CPU, in nanoseconds (the
ticks of /proc's `stat` round each thread down by up to 10 ms, which for hundreds of threads is most of what they
spend). Where there is no /proc there is nothing to report. A thread that ended keeps counting for its label with
what it had at the last read.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

TASKS = Path("/proc/self/task")


def thread_label(name: str) -> str:
    """A thread's name without the number its pool gave it: `line_12`, `ThreadPoolExecutor-0_3` and `Thread-3
    (serve)` are `line`, `ThreadPoolExecutor` and `Thread (serve)`."""
    return re.sub(r"[-_]\d[\d_-]*(?= \(|$)", "", name)


def thread_cpu_s(native_id: int) -> float | None:
    """CPU seconds of thread `native_id` of this process; None once it has ended, or where there is no /proc."""
    try:
        return int((TASKS / str(native_id) / "schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class ThreadCpu:
    """CPU seconds by thread label since this process started, including threads that ended since."""

    def __init__(self) -> None:
        # each thread (the object, not its native id, which the kernel gives again to a later thread) -> (its
        # label, its CPU seconds at the last read)
        self._seen: dict[threading.Thread, tuple[str, float]] = {}
        self._ended: Counter[str] = Counter()
        self._lock = threading.Lock()  # two scrapes at once must not count an ended thread twice

    def totals(self) -> dict[str, float]:
        with self._lock:
            now: dict[threading.Thread, tuple[str, float]] = {}
            for thread in threading.enumerate():
                if thread.native_id is not None and (cpu := thread_cpu_s(thread.native_id)) is not None:
                    now[thread] = (thread_label(thread.name), cpu)
            for thread, (label, cpu) in self._seen.items():
                if thread not in now:
                    self._ended[label] += cpu
            self._seen = now
            totals = Counter(self._ended)
            for label, cpu in now.values():
                totals[label] += cpu
            return dict(totals)


class ThreadCpuCollector(Collector):
    def __init__(self, threads: ThreadCpu | None = None) -> None:
        self.threads = threads or ThreadCpu()

    def collect(self) -> Iterator[Metric]:
        totals = self.threads.totals()
        if not totals:
            return
        family = CounterMetricFamily("convoq_worker_thread_cpu_seconds", "CPU time of this worker's threads, by "
                                     "what they do (their name, its number left out)", labels=["thread"])
        for label, seconds in sorted(totals.items()):
            family.add_metric([label], seconds)
        yield family
