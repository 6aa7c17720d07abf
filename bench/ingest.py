"""Batch ingest: how fast an upload's lines become jobs, and what it costs the API process in memory.

    python -m bench.ingest --json

Starts a PostgreSQL, a Redis, the API and a worker of its own (real processes, loopback only; the worker takes
interactive work only: the batch's jobs are not run), warms the API up with a small batch, times `CHATS` chats
one after another on the idle service, then uploads one batch of `--lines` lines (OpenAI Batch lines of about a
kilobyte each: 20,000 make 22 MB) as the `openai` SDK does (the file, then a batch naming it) while chats go one
after another until every line's message is sent. `chat_during_ingest_ratio` is the median latency of the chats
sent from the upload to the last message over their median on the idle service, side by side in one run.
`lines_per_s` counts the lines
over the time from the upload's 202 to the batch seen `in_progress` (polled every 50 ms: every line validated,
checked against the model's context and stored as a job); `published_lines_per_s` to every job's message sent
(the broker's queues stopped growing, every job found in a message: the lines can run); `upload_s` is the upload itself (the file stored, then the batch's 202).
`api_rss_growth_mb` is the API process's peak resident memory from the upload's start to the last publish, over
its resident memory before it: the kernel's own peak (`VmHWM`, reset first through `clear_refs`) where it can
be reset, else the largest of samples taken every 10 ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import openai
import redis
import sqlalchemy as sa

from bench.audit import messages_by_job
from bench.common import percentile, report, tiny_model
from broker.redis_layout import queue_lists
from cli.servers import PostgresServer, RedisServer
from cli.stack import Stack
from jobs.settings import Settings
from migrations.apply import upgrade

KEY = "bench-key-not-a-secret"
MB = 10**6
WARM_UP = 50  # lines of the batch sent first, whose messages wait in the broker too
CHATS = 10  # chats timed on the idle service
CHAT = [{"role": "user", "content": "Where is my parcel?"}]


def batch_lines(n: int) -> bytes:
    """`n` OpenAI Batch lines of about a kilobyte (a customer's long message)."""
    words = "my parcel was due on Monday and has not arrived, the tracking page says nothing new; "
    return b"".join(json.dumps({
        "custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "tiny", "max_tokens": 8,
                 "messages": [{"role": "user", "content": f"Order {i}: " + words * 11}]}}).encode() + b"\n"
        for i in range(n))


def _status_kb(pid: int, field: str) -> int:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith(field + ":"):
            return int(row.split()[1])
    raise KeyError(field)


class PeakRss:
    """The peak resident memory of a process between `start` and `stop`, in bytes."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sampled = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.exact = False

    def start(self) -> None:
        try:  # "5" resets the kernel's peak (VmHWM) to the current resident size
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            self.exact = True
        except OSError:
            self.exact = False
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.01):
            self.sampled = max(self.sampled, _status_kb(self.pid, "VmRSS") * 1024)

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(self.sampled, _status_kb(self.pid, "VmHWM") * 1024 if self.exact else 0)


def wait_in_progress(db: sa.Engine, batch_id: str, timeout: float) -> tuple[str, int]:
    """Poll until the batch leaves `validating`: its status and its jobs."""
    deadline = time.monotonic() + timeout
    while True:
        with db.connect() as conn:
            status = conn.execute(sa.text("SELECT status FROM batches WHERE id = :i"), {"i": batch_id}).scalar_one()
            if status != "validating":
                jobs = conn.execute(sa.text("SELECT count(*) FROM jobs WHERE batch_id = :i"), {"i": batch_id}).scalar_one()
                return status, jobs
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id} still validating after {timeout}s")
        time.sleep(0.05)


def wait_published(broker: redis.Redis, settings: Settings, db: sa.Engine, timeout: float) -> float:
    """Poll the broker until every line of every batch has its message (a grouped message carries several) and
    its queues stopped growing (no worker takes bulk work from them); returns when they last grew."""
    deadline = time.monotonic() + timeout
    lists = [name for names in queue_lists(settings).values() for name in names]
    with db.connect() as conn:
        lines = set(conn.execute(sa.text("SELECT id FROM jobs WHERE batch_id IS NOT NULL")).scalars())
    seen, grew = -1, time.monotonic()
    while True:
        if (waiting := sum(broker.llen(name) for name in lists)) != seen:
            seen, grew = waiting, time.monotonic()
        elif time.monotonic() - grew >= 1.0 and not lines - messages_by_job(broker, settings).keys():
            return grew
        if time.monotonic() > deadline:
            raise TimeoutError(f"the batch's messages were not all sent after {timeout}s")
        time.sleep(0.05)


class Chats:
    """Chats sent through the `openai` SDK one after another, on a thread of their own until `stop`: when each
    started and its latency in ms."""

    def __init__(self, sdk: openai.OpenAI, model: str) -> None:
        self.sdk, self.model = sdk, model
        self.sent: list[tuple[float, float]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._send, daemon=True)

    def one(self) -> tuple[float, float]:
        start = time.monotonic()
        self.sdk.chat.completions.create(model=self.model, messages=CHAT, max_tokens=4)
        return start, (time.monotonic() - start) * 1000

    def _send(self) -> None:
        while not self._done.is_set():
            self.sent.append(self.one())

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def upload(sdk: openai.OpenAI, body: bytes) -> str:
    """A batch made as the `openai` SDK makes one: its file uploaded, then named by `input_file_id`."""
    file = sdk.files.create(file=("batch.jsonl", body), purpose="batch")
    return sdk.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h").id


def run(n_lines: int, timeout: float) -> dict:
    data = batch_lines(n_lines)
    model = str(tiny_model())
    pg, broker = PostgresServer().start(), RedisServer().start()
    try:
        upgrade(pg.url)
        db = sa.create_engine(pg.url)
        client = redis.Redis.from_url(broker.url)
        env = {"CONVOQ_DATABASE_URL": pg.url, "CONVOQ_BROKER_URL": broker.url, "CONVOQ_MODEL": model,
               "CONVOQ_API_KEYS": KEY,
               # OpenAI's 200 MB holds 50,000 lines of 4 kB, beyond the tiny model's context: 1 kB lines, more of them
               "CONVOQ_MAX_BATCH_LINES": str(max(n_lines, 50_000)),
               "CONVOQ_MAX_QUEUED_PER_KEY": str(max(n_lines + 100, 100_000))}
        with Stack(env, Path(tempfile.mkdtemp(prefix="convoq-ingest-"))) as stack:
            stack.start_api()
            stack.start_worker("--queues", Settings().interactive_queue)  # chats only: the batch's jobs wait
            sdk = openai.OpenAI(base_url=f"{stack.api_url}/v1", api_key=KEY, timeout=600, max_retries=0)
            chats = Chats(openai.OpenAI(base_url=f"{stack.api_url}/v1", api_key=KEY, timeout=600, max_retries=0),
                          model)
            wait_in_progress(db, upload(sdk, batch_lines(WARM_UP)), timeout)  # warm-up: pools, parsers, the tokenizer
            chats.one()  # the worker's first chat compiles and allocates: not a latency
            idle_ms = [chats.one()[1] for _ in range(CHATS)]
            before = _status_kb(stack.api.pid, "VmRSS") * 1024
            peak = PeakRss(stack.api.pid)
            peak.start()
            chats.start()
            start = time.monotonic()
            batch_id = upload(sdk, data)
            accepted = time.monotonic()
            status, jobs = wait_in_progress(db, batch_id, timeout)
            ingest_s = time.monotonic() - accepted
            published = wait_published(client, Settings(broker_url=broker.url), db, timeout)
            chats.stop()
            peak_rss = peak.stop()
        db.dispose()
        client.close()
    finally:
        pg.stop()
        broker.stop()
    # the chats sent while the batch was uploaded, ingested and published
    busy_ms = [ms for sent, ms in chats.sent if sent < published]
    return {
        "lines": n_lines,
        "upload_mb": round(len(data) / MB, 1),
        "status": status,
        "jobs": jobs,
        "upload_s": round(accepted - start, 2),
        "ingest_s": round(ingest_s, 2),
        "lines_per_s": round(n_lines / ingest_s, 1),
        "published_s": round(published - accepted, 2),
        "published_lines_per_s": round(n_lines / (published - accepted), 1),
        "api_rss_before_mb": round(before / MB, 1),
        "api_rss_peak_mb": round(peak_rss / MB, 1),
        "api_rss_growth_mb": round((peak_rss - before) / MB, 1),
        "peak_is_exact": peak.exact,
        "chats_idle": len(idle_ms),
        "chats_during_ingest": len(busy_ms),
        "chat_p50_idle_ms": round(statistics.median(idle_ms), 1),
        "chat_p50_during_ingest_ms": round(statistics.median(busy_ms), 1),
        "chat_p95_during_ingest_ms": round(percentile(busy_ms, 0.95), 1),
        "chat_max_during_ingest_ms": round(max(busy_ms), 1),
        "chat_during_ingest_ratio": round(statistics.median(busy_ms) / statistics.median(idle_ms), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=20_000,
                        help="lines of about 1.1 kB each: 178,000 make 198 MB (OpenAI's largest batch file is 200 MB)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for the batch to open")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    report(run(args.lines, args.timeout), args.json)


if __name__ == "__main__":
    main()
