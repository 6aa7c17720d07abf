"""Progress of the jobs a worker runs, published on Redis pub/sub for `GET /v1/jobs/{id}/events`.

Events are published only for jobs someone is subscribed to (one PUBSUB NUMSUB per flush asks). Most jobs, a
batch's lines above all, are followed by nobody, and a publish each would cost the worker and Redis for nothing.
Nothing is stored either. A subscriber reads the job's row once subscribed, and a status is queued here only
once the row says so, so it misses nothing. Status changes go out as they happen; text at most once per
`interval` per job, and always as the whole text so far, so a subscriber that connects late is up to date with
its first text event. Each text event names its run (the lease of the claim that produced it), because a job
handed back and run again samples a new text, and the API must tell it from the old one's. Publishing is
best-effort, so a Redis error loses progress events, never a job.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid

import redis

from broker.redis_layout import progress_channel
from jobs.status import TERMINAL, JobStatus

log = logging.getLogger(__name__)


class ProgressPublisher:
    def __init__(self, redis_url: str, tokenizer, interval: float = 0.1) -> None:
        self.client = redis.Redis.from_url(redis_url)
        self.tokenizer = tokenizer
        self.interval = interval
        self._statuses: list[tuple[str, JobStatus]] = []
        self._tokens: dict[str, tuple[str | None, list[int]]] = {}  # job id -> (its run, its latest output so far)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._thread.start()

    def status(self, job_id: str, status: JobStatus) -> None:
        with self._lock:
            self._statuses.append((job_id, status))
            if status in TERMINAL:
                self._tokens.pop(job_id, None)  # the final event carries the whole result

    def tokens(self, job_id: str, token_ids: list[int], run: uuid.UUID | None = None) -> None:
        """The output so far of the job's run `run` (called on the engine thread: only a dict write)."""
        with self._lock:
            self._tokens[job_id] = (None if run is None else str(run), token_ids)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._flush()
        self.client.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._flush()

    def _flush(self) -> None:
        with self._lock:
            statuses, self._statuses = self._statuses, []
            tokens, self._tokens = self._tokens, {}
        if not statuses and not tokens:
            return
        try:
            watched = self._watched(list(dict.fromkeys([*(job_id for job_id, _ in statuses), *tokens])))
            if not watched:
                return
            statuses = [(job_id, status) for job_id, status in statuses if job_id in watched]
            pipe = self.client.pipeline(transaction=False)
            ending = [(j, s) for j, s in statuses if s in TERMINAL]
            for job_id, status in (x for x in statuses if x[1] not in TERMINAL):
                pipe.publish(progress_channel(job_id), json.dumps({"event": "status", "status": status.value}))
            for job_id in (j for j in tokens if j in watched):
                run, ids = tokens[job_id]
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                pipe.publish(progress_channel(job_id),
                             json.dumps({"event": "text", "text": text, "tokens": len(ids), "run": run}))
            for job_id, status in ending:
                pipe.publish(progress_channel(job_id), json.dumps({"event": "status", "status": status.value}))
            pipe.execute()
        except redis.RedisError as exc:
            log.warning("progress events lost: %s", exc)

    def _watched(self, job_ids: list[str]) -> set[str]:
        if not job_ids:
            return set()
        counts = self.client.pubsub_numsub(*(progress_channel(j) for j in job_ids))
        return {j for j, (_, n) in zip(job_ids, counts, strict=True) if n > 0}
