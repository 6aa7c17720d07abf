"""The engine with nothing around it: what a benchmark divides the service's throughput by."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

from tqdm import tqdm

from jobs.schemas import JobIn
from jobs.settings import Settings
from worker.bridge import Bridge
from worker.engine_factory import start_engine
from worker.outcome import Outcome
from worker.runs import RUN_BY_KIND


def through_engine(jobs: list[JobIn], settings: Settings, threads: int) -> tuple[float, list[Outcome], float]:
    """Run `jobs` as a worker would (its bridge, its engine runner, as many at a time as it has threads) with no
    broker and no database around them: seconds taken, the outcomes, and the engine loop's gap p95 (ms)."""
    bridge = Bridge.for_settings(start_engine(settings), settings)
    created = datetime.now(UTC)

    def run(i: int, job: JobIn) -> Outcome:
        with bridge.run(f"engine-alone-{i}", job, created) as job_run:
            return RUN_BY_KIND[job.kind](job_run)

    try:
        start = time.monotonic()
        with ThreadPoolExecutor(threads) as pool, tqdm(total=len(jobs), desc="engine", file=sys.stderr) as bar:
            outcomes = []
            for outcome in pool.map(run, range(len(jobs)), jobs):
                outcomes.append(outcome)
                bar.update()
        elapsed = time.monotonic() - start
        gap_ms = bridge.stats().loop_gap_p95_ms
    finally:
        bridge.close()
    if not all(o.completion.ok for o in outcomes):
        raise RuntimeError("the engine alone failed some jobs")
    return elapsed, outcomes, gap_ms
