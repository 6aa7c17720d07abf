"""`convoq report`: one self-contained HTML page of how jobs fared, read from the jobs and timings tables.

Plots are PNGs drawn with matplotlib's Agg canvas and inlined as base64, so the page can be mailed or
attached to a ticket as one file. Times are UTC; durations are seconds.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from cli.report_plots import (
    PERCENTILES,
    Buckets,
    batch_size_plot,
    interactive_vs_bulk_plot,
    latency_plot,
    reuse_plot,
    throughput_plot,
    wait_vs_compute_plot,
)
from cli.spans import parse_span
from jobs.settings import Settings
from jobs.status import JobStatus
from jobs.tables import Job, Result, Timing, Worker, as_utc
from store.connections import make_db_engine, make_sessions


def parse_since(text: str, now: datetime) -> datetime:
    """An ISO 8601 time (UTC unless it says otherwise) or a span back from `now`: 90s, 30m, 2h, 1d, 1w."""
    if (span := parse_span(text)) is not None:
        return now - span
    try:
        return as_utc(datetime.fromisoformat(text.strip())).astimezone(UTC)
    except ValueError:
        raise ValueError(f"--since {text!r}: give an ISO 8601 time or a span like 30m, 2h, 1d") from None


@dataclass
class Finished:
    """Jobs with a timings row (those that succeeded), one array entry per job; `at` is epoch seconds."""

    priority: np.ndarray
    at: np.ndarray
    end_to_end: np.ndarray
    queue_wait: np.ndarray
    ttft: np.ndarray
    prefill: np.ndarray
    decode: np.ndarray
    batch_size: np.ndarray
    reused: np.ndarray
    host_reused: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    worker: np.ndarray  # the worker that ran it
    previous_worker: np.ndarray  # the one that took its conversation's previous job ("" for none)

    @classmethod
    def from_rows(cls, rows: list) -> Finished:
        columns = list(zip(*rows, strict=True)) if rows else [()] * len(fields(cls))
        priority, at, e2e, wait, ttft, prefill, decode, *counts, worker, previous = columns
        seconds = [np.asarray(c, dtype=float) / 1e3 for c in (e2e, wait, ttft, prefill, decode)]
        return cls(np.asarray(priority, dtype=int), np.asarray([as_utc(t).timestamp() for t in at], dtype=float),
                   *seconds, *(np.asarray(c, dtype=int) for c in counts),
                   *(np.asarray([w or "" for w in c], dtype=object) for c in (worker, previous)))

    def __len__(self) -> int:
        return len(self.at)


def load(session: Session, since: datetime) -> tuple[dict[str, int], Finished]:
    """Counts by status of the jobs created since `since`, and the timings of those that finished."""
    statuses = dict(session.execute(
        select(Job.status, func.count()).where(Job.created_at >= since).group_by(Job.status)
    ).all())
    previous_worker = func.lag(Job.worker).over(partition_by=(Job.tenant, Job.conversation_id),
                                                order_by=Job.created_at)
    rows = session.execute(
        select(Job.priority, Timing.created_at, Timing.end_to_end_ms, Timing.queue_wait_ms, Timing.ttft_ms,
               Timing.prefill_ms, Timing.decode_ms, Timing.batch_size, Timing.prompt_tokens_reused,
               Timing.host_tokens_reused, Result.prompt_tokens, Result.completion_tokens, Job.worker,
               case((Job.conversation_id.is_(None), None), else_=previous_worker))
        .join(Timing, Timing.job_id == Job.id)
        .join(Result, Result.job_id == Job.id)
        .where(Job.created_at >= since)
        .order_by(Timing.created_at)
    ).all()
    return statuses, Finished.from_rows(rows)


def load_workers(session: Session, since: datetime) -> list:
    """The workers that beat since `since`, with what they used over their lives (`Worker.cpu_s`)."""
    return session.execute(
        select(Worker.name, Worker.started_at, Worker.heartbeat_at, Worker.cpu_s, Worker.jobs_finished)
        .where(Worker.heartbeat_at >= since).order_by(Worker.started_at, Worker.name)
    ).all()


def usage_rows(workers: list) -> list[list[str]]:
    """One row per worker: its life, the jobs it finished and its CPU over that life, and CPU per job."""
    rows = []
    for w in workers:
        per_job = f"{1e3 * w.cpu_s / w.jobs_finished:.2f}" if w.cpu_s is not None and w.jobs_finished else "-"
        rows.append([w.name, f"{as_utc(w.started_at):%Y-%m-%d %H:%M:%S}", f"{as_utc(w.heartbeat_at):%Y-%m-%d %H:%M:%S}",
                     "-" if w.jobs_finished is None else str(w.jobs_finished),
                     "-" if w.cpu_s is None else f"{w.cpu_s:.1f}", per_job])
    return rows


USAGE_HEADER = ["worker", "started", "last heartbeat", "jobs finished", "CPU (s)", "CPU per job (ms)"]
USAGE_NOTE = ("<p>Over each worker's life, as of its last heartbeat: the CPU time of the worker process and of its "
              "engine process, and the jobs it brought to an end. An API process serves its CPU time as "
              "<code>process_cpu_seconds_total</code> on <code>/metrics</code>: its rate over that of the workers' "
              "<code>convoq_jobs_finished_total</code> is the API's CPU per job.</p>")


def seconds(values: np.ndarray, q: float) -> str:
    return f"{np.percentile(values, q):.3f}"


def reused_percent(jobs: Finished, mask: np.ndarray) -> str:
    prompt = jobs.prompt_tokens[mask].sum()
    return f"{100 * jobs.reused[mask].sum() / prompt:.1f}" if prompt else "-"


def priority_rows(jobs: Finished) -> list[list[str]]:
    """One row per priority, then one for all jobs: counts, latency percentiles, batch size, tokens."""
    groups = [(str(p), jobs.priority == p) for p in np.unique(jobs.priority)[::-1]]
    rows = []
    for name, mask in [*groups, ("all", np.ones(len(jobs), dtype=bool))]:
        e2e = jobs.end_to_end[mask]
        rows.append([name, str(mask.sum()), *(seconds(e2e, q) for q in PERCENTILES),
                     seconds(jobs.queue_wait[mask], 50), seconds(jobs.ttft[mask], 50),
                     f"{jobs.batch_size[mask].mean():.1f}", reused_percent(jobs, mask),
                     str(jobs.output_tokens[mask].sum())])
    return rows


def worker_rows(jobs: Finished) -> list[list[str]]:
    """One row per worker: jobs, prefix reuse, and of the later turns of conversations, the share that ran where
    the conversation's previous turn had (`broker.affinity`)."""
    rows = []
    for name in sorted(set(jobs.worker)):
        mask = jobs.worker == name
        later = mask & (jobs.previous_worker != "")
        home = f"{100 * (jobs.previous_worker[later] == name).mean():.1f}" if later.any() else "-"
        rows.append([name or "-", str(mask.sum()), reused_percent(jobs, mask), str(later.sum()), home])
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def status_table(statuses: dict[str, int]) -> str:
    known = [s.value for s in JobStatus]
    names = known + sorted(set(statuses) - set(known))
    return table(["status", "jobs"], [[s, str(statuses.get(s, 0))] for s in names] +
                 [["total", str(sum(statuses.values()))]])


def section(anchor: str, title: str, body: str) -> str:
    return f'<section id="{anchor}"><h2>{html.escape(title)}</h2>{body}</section>'


def image(data: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def finished_sections(jobs: Finished, settings: Settings) -> list[str]:
    buckets = Buckets.over(jobs.at)
    header = ["priority", "succeeded", "p50 end-to-end (s)", "p95 end-to-end (s)", "p99 end-to-end (s)",
              "p50 queue wait (s)", "p50 time to first token (s)", "mean batch size", "prompt tokens reused (%)",
              "output tokens"]
    return [
        section("latency-summary", "Latency by priority", table(header, priority_rows(jobs))),
        section("latency", "End-to-end latency percentiles over time",
                image(latency_plot(jobs, buckets), "latency percentiles by priority")),
        section("throughput", "Throughput", image(throughput_plot(jobs, buckets), "throughput")),
        section("interactive-vs-bulk", "Interactive latency against bulk throughput",
                image(interactive_vs_bulk_plot(jobs, buckets, settings),
                      "interactive latency and bulk throughput over time")),
        section("wait-vs-compute", "Queue wait vs compute",
                image(wait_vs_compute_plot(jobs), "queue wait vs compute by priority")),
        section("batch-size", "Batch size", image(batch_size_plot(jobs), "batch size distribution")),
        section("prefix-reuse", "Prefix reuse", image(reuse_plot(jobs, buckets), "prefix reuse over time") + table(
            ["worker", "succeeded", "prompt tokens reused (%)", "later turns of conversations",
             "of those, on the previous turn's worker (%)"], worker_rows(jobs))),
    ]


def render(statuses: dict[str, int], jobs: Finished, since: datetime, now: datetime,
           settings: Settings, workers: list = ()) -> str:
    """The page; `workers`: those of `load_workers`."""
    window = f"{since:%Y-%m-%d %H:%M} to {now:%Y-%m-%d %H:%M} UTC"
    if not statuses:
        parts = [f'<p class="empty">No jobs were created from {window}: nothing to report.</p>']
    else:
        parts = [section("statuses", "Jobs by status", status_table(statuses))]
        parts += finished_sections(jobs, settings) if len(jobs) else [NOTHING_FINISHED]
    if workers:
        parts.append(section("cpu", "CPU per job, by worker", USAGE_NOTE + table(USAGE_HEADER, usage_rows(workers))))
    return PAGE.format(window=window, generated=f"{now:%Y-%m-%d %H:%M:%S}", body="\n".join(parts))


def write_report(settings: Settings, since: datetime, out: Path) -> Path:
    """The page for the jobs created since `since` in the database of `settings`, which also say which jobs are
    interactive."""
    now = datetime.now(UTC)
    engine = make_db_engine(settings.database_url.get_secret_value(), pool_size=1)
    try:
        with make_sessions(engine)() as session:
            statuses, jobs = load(session, since)
            workers = load_workers(session, since)
    finally:
        engine.dispose()
    out.write_text(render(statuses, jobs, since, now, settings, workers), encoding="utf-8")
    return out


NOTHING_FINISHED = '<p class="empty">None of these jobs has succeeded yet: nothing to plot.</p>'

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>convoq report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1340px; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5rem 0 1.5rem; }}
th, td {{ border: 1px solid #ccc; padding: 0.3rem 0.7rem; text-align: right; }}
th {{ background: #f3f3f3; }}
td:first-child, th:first-child {{ text-align: left; }}
img {{ max-width: 100%; }}
.empty {{ font-size: 1.2rem; color: #666; }}
</style></head>
<body>
<h1>convoq report</h1>
<p>Jobs created from {window}; generated {generated} UTC. Durations in seconds; queue wait and time to first
token count from job creation.</p>
{body}
</body></html>
"""
