"""`convoq report` against a seeded PostgreSQL database: sections, inline plots, and numbers that match."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from cli.main import app
from cli.report import Finished, parse_since, render, write_report
from jobs.settings import Settings
from jobs.tables import Job, Result, Timing, Worker

NOW = datetime.now(UTC)
SUCCEEDED = 240
OTHERS = {"failed": 30, "queued": 20, "cancelled": 10}
PRIORITIES = (9, 5, 1)
SECTIONS = ("statuses", "latency-summary", "latency", "throughput", "interactive-vs-bulk", "wait-vs-compute", "batch-size",
            "prefix-reuse", "cpu")


def e2e_ms(i: int) -> float:
    return (i + 1) * 10.0  # 10 ms .. 2.4 s: a distribution whose percentiles are known


def conversation(i: int) -> str | None:
    """The first 80 jobs are 20 conversations of 4 turns."""
    return f"c{i // 4}" if i < 80 else None


def worker(i: int) -> str:
    """A conversation's turns run on one worker, but for the last turn of the first; other jobs alternate."""
    if i < 80 and i != 3:
        return "w-a" if (i // 4) % 2 == 0 else "w-b"
    return "w-a" if i % 2 == 0 and i != 3 else "w-b"


def succeeded(i: int, created: datetime) -> tuple[dict, dict, dict]:
    job_id = uuid.uuid4()
    finished = created + timedelta(milliseconds=e2e_ms(i))
    job = dict(id=job_id, status="succeeded", kind="chat", priority=PRIORITIES[i % 3], payload={},
               created_at=created, finished_at=finished, conversation_id=conversation(i), worker=worker(i))
    result = dict(job_id=job_id, text="ok", prompt_tokens=100, completion_tokens=20, finish_reason="stop",
                  created_at=finished)
    timing = dict(job_id=job_id, queue_wait_ms=e2e_ms(i) / 2, ttft_ms=e2e_ms(i) * 0.6, prefill_ms=e2e_ms(i) / 10,
                  decode_ms=e2e_ms(i) * 0.4, engine_ms=e2e_ms(i) / 2, end_to_end_ms=e2e_ms(i), tokens_per_s=40.0,
                  engine_step=f"w:{i // 4}", batch_size=i % 16 + 1, prompt_tokens_reused=(i % 3) * 30,
                  host_tokens_reused=(i % 3) * 10, created_at=finished)
    return job, result, timing


def seed(database: str) -> None:
    """Jobs over the last three hours, plus older ones that a one-day window must leave out."""
    recent = [succeeded(i, NOW - timedelta(hours=3) + timedelta(seconds=45 * i)) for i in range(SUCCEEDED)]
    old = [succeeded(i, NOW - timedelta(days=3)) for i in range(20)]
    jobs, results, timings = (list(rows) for rows in zip(*recent, *old, strict=True))
    for status, n in OTHERS.items():
        created = NOW - timedelta(minutes=n + 1)
        jobs += [dict(id=uuid.uuid4(), status=status, kind="summarize", priority=1, payload={}, created_at=created,
                      finished_at=None if status == "queued" else created, conversation_id=None, worker=None)
                 for _ in range(n)]
    workers = [dict(name="w-a", hostname="h", pid=1, started_at=NOW - timedelta(hours=4), heartbeat_at=NOW,
                    cpu_s=12.5, jobs_finished=500),
               dict(name="w-new", hostname="h", pid=2, started_at=NOW, heartbeat_at=NOW, cpu_s=None,
                    jobs_finished=None),  # its first beat, before it had a figure
               dict(name="w-gone", hostname="h", pid=3, started_at=NOW - timedelta(days=3),
                    heartbeat_at=NOW - timedelta(days=2), cpu_s=1.0, jobs_finished=10)]  # outside the window
    engine = sa.create_engine(database)
    with engine.begin() as conn:
        conn.execute(sa.insert(Worker), workers)
        conn.execute(sa.insert(Job), jobs)
        conn.execute(sa.insert(Result), results)
        conn.execute(sa.insert(Timing), timings)
    engine.dispose()


def test_report_of_a_seeded_database(database, tmp_path):
    seed(database)
    out = write_report(Settings(database_url=database), parse_since("1d", NOW), tmp_path / "report.html")

    page = out.read_text()
    for anchor in SECTIONS:
        assert f'<section id="{anchor}">' in page
    assert page.count('src="data:image/png;base64,') == 6
    assert "<tr><td>succeeded</td><td>240</td></tr>" in page  # the 20 older jobs are outside the window
    for status, n in OTHERS.items():
        assert f"<tr><td>{status}</td><td>{n}</td></tr>" in page
    assert "<tr><td>total</td><td>300</td></tr>" in page
    e2e = np.array([e2e_ms(i) for i in range(SUCCEEDED)]) / 1e3
    p50, p95, p99 = (f"{np.percentile(e2e, q):.3f}" for q in (50, 95, 99))
    assert p50 == "1.205"
    assert f"<tr><td>all</td><td>240</td><td>{p50}</td><td>{p95}</td><td>{p99}</td>" in page
    # mean batch size, share of prompt tokens reused, output tokens: all priorities
    assert f"<td>8.5</td><td>30.0</td><td>{SUCCEEDED * 20}</td></tr></tbody>" in page
    # by worker: jobs, reuse, later turns of conversations and the share on their previous turn's worker (one
    # turn of w-a's first conversation ran on w-b)
    # CPU per job by worker, over each one's life: 12.5 s over 500 jobs
    at = f"{NOW - timedelta(hours=4):%Y-%m-%d %H:%M:%S}"
    assert f"<tr><td>w-a</td><td>{at}</td><td>{NOW:%Y-%m-%d %H:%M:%S}</td><td>500</td><td>12.5</td><td>25.00</td></tr>" in page
    assert "<td>w-new</td>" in page and "<td>-</td><td>-</td><td>-</td></tr>" in page and "w-gone" not in page
    for name, later, home in (("w-a", 29, "100.0"), ("w-b", 31, f"{100 * 30 / 31:.1f}")):
        ran = [i for i in range(SUCCEEDED) if worker(i) == name]
        reused = f"{100 * sum((i % 3) * 30 for i in ran) / (100 * len(ran)):.1f}"
        assert f"<tr><td>{name}</td><td>{len(ran)}</td><td>{reused}</td><td>{later}</td><td>{home}</td></tr>" in page


def test_report_of_an_empty_window(database, tmp_path):
    page = write_report(Settings(database_url=database), parse_since("2h", NOW), tmp_path / "empty.html").read_text()
    assert "nothing to report" in page
    assert "<img" not in page


def test_report_of_jobs_that_have_not_succeeded_yet():
    page = render({"queued": 3, "failed": 1}, Finished.from_rows([]), NOW - timedelta(hours=1), NOW, Settings())
    assert "<tr><td>total</td><td>4</td></tr>" in page
    assert "nothing to plot" in page and "<img" not in page


def test_report_command_writes_the_page(database, tmp_path, monkeypatch):
    seed(database)
    monkeypatch.setenv("CONVOQ_DATABASE_URL", database)
    out = tmp_path / "cli.html"
    result = CliRunner().invoke(app, ["report", "--since", "30m", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.exists() and "<h1>convoq report</h1>" in out.read_text()
    assert CliRunner().invoke(app, ["report", "--since", "yesterday"]).exit_code == 2


@pytest.mark.parametrize(("text", "expected"), [
    ("2h", NOW - timedelta(hours=2)),
    ("1.5d", NOW - timedelta(hours=36)),
    ("2026-01-02T03:04:05", datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)),
    ("2026-01-02T03:04:05+02:00", datetime(2026, 1, 2, 1, 4, 5, tzinfo=UTC)),
])
def test_since_accepts_spans_and_iso_times(text, expected):
    assert parse_since(text, NOW) == expected


def test_a_run_of_seconds_is_plotted_over_seconds_with_its_date_in_the_axis_label():
    from matplotlib.figure import Figure

    from cli.report_plots import Buckets, time_axis

    start = datetime(2026, 12, 1, 23, 59, 50, tzinfo=UTC).timestamp()
    buckets = Buckets.over(np.array([start + 0.5 * i for i in range(30)]))  # a 15-second demo, across midnight
    assert buckets.width == 1 and len(buckets.centers) == 15
    ax = Figure().add_subplot()
    ax.plot(buckets.centers, np.arange(15))
    time_axis(ax, buckets)
    ax.figure.canvas.draw()
    assert ax.get_xlabel() == "finished at (UTC), 2026-12-01 to 2026-12-02"
    assert ax.xaxis.get_offset_text().get_text() == ""
    hours = Buckets.over(np.array([start + 60.0 * i for i in range(180)]))  # three hours: minutes still
    assert hours.width == 300  # 36 five-minute points
