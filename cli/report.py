"""`convoq report`: one self-contained HTML page of how jobs fared, read from the jobs and timings tables.

Plots are PNGs drawn with matplotlib's Agg canvas and inlined as base64, so the page can be mailed or
attached to a ticket as one file. Times are UTC; durations are seconds.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
from matplotlib.figure import Figure
from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from cli.spans import parse_span
from jobs.priority import HIGHEST
from jobs.queues import is_interactive
from jobs.settings import Settings
from jobs.status import JobStatus
from jobs.tables import Job, Result, Timing, Worker, as_utc
from store.connections import make_db_engine, make_sessions

# seconds: from a demo's few seconds to weeks of service, the smallest that keeps under MAX_BUCKETS points
BUCKET_WIDTHS = (1, 2, 5, 10, 15, 30, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 86400, 7 * 86400)
MAX_BUCKETS = 60  # enough points for a trend, enough jobs per point for a p99
PERCENTILES = (50, 95, 99)
PRIORITY_COLORS = colormaps["tab10"]


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


@dataclass
class Buckets:
    """Equal time slices over the finish times: `index` puts each job in one, `centers` places them on a plot."""

    width: float  # seconds
    index: np.ndarray
    centers: list[datetime]

    @classmethod
    def over(cls, at: np.ndarray) -> Buckets:
        span = at.max() - at.min()
        width = next((w for w in BUCKET_WIDTHS if span / w < MAX_BUCKETS), BUCKET_WIDTHS[-1])
        origin = at.min() // width * width
        index = ((at - origin) // width).astype(int)
        centers = [datetime.fromtimestamp(origin + (i + 0.5) * width, UTC) for i in range(index.max() + 1)]
        return cls(width, index, centers)

    def apply(self, values: np.ndarray, reduce: Callable[[np.ndarray], float], where: np.ndarray | None = None
              ) -> np.ndarray:
        """`reduce` of the values in each bucket (NaN where a bucket is empty), optionally of a subset only."""
        keep = np.ones(len(values), dtype=bool) if where is None else where
        out = np.full(len(self.centers), np.nan)
        for i in np.unique(self.index[keep]):
            out[i] = reduce(values[keep & (self.index == i)])
        return out


def png(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return base64.b64encode(buffer.getvalue()).decode()


def time_axis(ax, buckets: Buckets) -> None:
    # the window's own span: matplotlib would pad a single bucket out to years
    half = timedelta(seconds=buckets.width / 2)
    ax.set_xlim(buckets.centers[0] - half, buckets.centers[-1] + half)
    locator = AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    # the date goes in the label: as the formatter's offset it is drawn over the label
    ax.xaxis.set_major_formatter(ConciseDateFormatter(locator, show_offset=False))
    first, last = (f"{c:%Y-%m-%d}" for c in (buckets.centers[0], buckets.centers[-1]))
    ax.set_xlabel(f"finished at (UTC), {first}" + (f" to {last}" if last != first else ""))
    ax.grid(alpha=0.3)


def latency_plot(jobs: Finished, buckets: Buckets) -> str:
    fig = Figure(figsize=(12, 4), layout="constrained")
    axes = fig.subplots(1, len(PERCENTILES), sharey=True)
    for ax, q in zip(axes, PERCENTILES, strict=True):
        for priority in np.unique(jobs.priority)[::-1]:  # the legend lists the most urgent first
            values = buckets.apply(jobs.end_to_end, lambda v, q=q: np.percentile(v, q), jobs.priority == priority)
            ax.plot(buckets.centers, values, marker="o", markersize=3, color=PRIORITY_COLORS(priority),
                    label=f"priority {priority}")
        ax.set_title(f"p{q}")
        time_axis(ax, buckets)
    axes[0].set_ylabel("end-to-end latency (s)")
    if np.nanmax(jobs.end_to_end) > 50 * max(np.nanmin(jobs.end_to_end), 1e-3):
        axes[0].set_yscale("log")  # urgent chats and hours-old bulk work on one axis
    axes[-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return png(fig)


def throughput_plot(jobs: Finished, buckets: Buckets) -> str:
    fig = Figure(figsize=(12, 5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    width_days = buckets.width / 86400
    # an empty bucket is a stretch with nothing finished: zero, not a gap
    per_minute = np.nan_to_num(buckets.apply(jobs.at, len)) / (buckets.width / 60)
    top.bar(buckets.centers, per_minute, width=width_days * 0.9, color="tab:blue")
    top.set_ylabel("jobs finished / min")
    top.grid(alpha=0.3)
    tokens_per_s = np.nan_to_num(buckets.apply(jobs.output_tokens, np.sum)) / buckets.width
    bottom.plot(buckets.centers, tokens_per_s, marker="o", markersize=3, color="tab:green")
    bottom.set_ylabel("output tokens / s")
    bottom.set_ylim(bottom=0)
    time_axis(bottom, buckets)
    fig.suptitle(f"Throughput ({buckets.width / 60:g}-minute buckets)")
    return png(fig)


def interactive_vs_bulk_plot(jobs: Finished, buckets: Buckets, settings: Settings) -> str:
    """The trade-off the scheduler makes, on one time axis: what urgent jobs wait, what bulk work gets done."""
    fig = Figure(figsize=(12, 5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    urgent = is_interactive(jobs.priority, settings)
    for q, style in ((50, "o-"), (95, "s--")):
        values = buckets.apply(jobs.end_to_end, lambda v, q=q: np.percentile(v, q), urgent)
        top.plot(buckets.centers, values, style, markersize=3, color="tab:red", label=f"p{q}")
    top.set_ylabel(f"priority >= {settings.interactive_priority}:\nend-to-end (s)")
    top.set_ylim(bottom=0)
    top.legend(fontsize="small", loc="upper left")
    top.grid(alpha=0.3)
    tokens_per_s = np.nan_to_num(buckets.apply(jobs.output_tokens, np.sum, ~urgent)) / buckets.width
    bottom.plot(buckets.centers, tokens_per_s, marker="o", markersize=3, color="tab:green")
    bottom.set_ylabel(f"priority < {settings.interactive_priority}:\noutput tokens / s")
    bottom.set_ylim(bottom=0)
    time_axis(bottom, buckets)
    fig.suptitle("Interactive latency against bulk throughput")
    return png(fig)


def wait_vs_compute_plot(jobs: Finished) -> str:
    """Mean seconds per job, and the same as shares: bulk waits would otherwise flatten the urgent bars."""
    fig = Figure(figsize=(12, 4), layout="constrained")
    absolute, share = fig.subplots(1, 2)
    priorities = np.unique(jobs.priority)
    labels = [str(p) for p in priorities]
    parts = (("queue wait", jobs.queue_wait, "tab:gray"), ("prefill", jobs.prefill, "tab:orange"),
             ("decode", jobs.decode, "tab:blue"))
    means = np.array([[values[jobs.priority == p].mean() for p in priorities] for _, values, _ in parts])
    for ax, heights in ((absolute, means), (share, 100 * means / means.sum(axis=0))):
        bottom = np.zeros(len(priorities))
        for (name, _, color), height in zip(parts, heights, strict=True):
            ax.bar(labels, height, bottom=bottom, label=name, color=color)
            bottom += height
        ax.set_xlabel(f"priority ({HIGHEST} is the most urgent)")
        ax.grid(axis="y", alpha=0.3)
    absolute.set_ylabel("mean seconds per job")
    share.set_ylabel("share of queue wait + compute (%)")
    share.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("Queue wait vs compute")
    return png(fig)


def batch_size_plot(jobs: Finished) -> str:
    fig = Figure(figsize=(9, 4), layout="constrained")
    ax = fig.subplots()
    sizes, counts = np.unique(jobs.batch_size, return_counts=True)
    ax.bar(sizes, counts, width=0.8 if sizes.max() <= 64 else sizes.max() / 80, color="tab:purple")
    ax.set_xlabel("batch size (largest engine step the job ran in)")
    ax.set_ylabel("jobs")
    ax.set_title("Batch size distribution")
    ax.grid(axis="y", alpha=0.3)
    return png(fig)


def reuse_plot(jobs: Finished, buckets: Buckets) -> str:
    fig = Figure(figsize=(12, 4), layout="constrained")
    ax = fig.subplots()
    prompt = buckets.apply(jobs.prompt_tokens, np.sum)
    for name, values, color in (("from the prefix cache", jobs.reused, "tab:green"),
                                ("of which from the host tier", jobs.host_reused, "tab:olive")):
        share = 100 * buckets.apply(values, np.sum) / np.where(prompt > 0, prompt, np.nan)
        ax.plot(buckets.centers, share, marker="o", markersize=3, color=color, label=name)
    ax.set_ylabel("prompt tokens reused (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Prefix reuse")
    ax.legend()
    time_axis(ax, buckets)
    return png(fig)


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
