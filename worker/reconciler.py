"""Nothing lost, nothing run twice. A worker's reconciler renews its leases and, when its turn comes, runs the
one sweep that hands back and sends again jobs.

Each worker beats once per `heartbeat_s` (`worker.heartbeat`), so its cost is constant per worker. The beat has
a thread of its own, so that no sweep, however long, delays it. The sweep (`worker.sweep`) runs on one worker at
a time, once per `sweep_every_s` across the fleet. It hands back jobs whose lease expired (`worker.crashes`),
ends queued jobs past their deadline, folds the status counts, prunes finished work hourly, and sends again the
queued jobs whose message is lost (`worker.resend`). It works in chunks, each its own short transaction, so its
cost follows the backlog, never the number of workers.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from broker.affinity import Advert
from engine.interface import FinishReason
from jobs.settings import Settings
from worker.heartbeat import Beat, beat
from worker.leases import Leases
from worker.sweep import Sweeper

log = logging.getLogger(__name__)


class Reconciler:
    """The reconciler of one worker process, on two threads. The heartbeat beats every `heartbeat_s`, renews
    the worker's leases and stops the runs it lost or whose cancel was asked for (`stop_jobs(ids, reason)`). The
    sweeper sweeps when a beat finds its turn come. They are apart so that no sweep or prune, however long, holds
    a beat back. Otherwise the leases of the sweeper's own jobs would expire under it, and charge them a
    crash."""

    def __init__(self, sessions: sessionmaker[Session], celery: Celery, settings: Settings, name: str,
                 leases: Leases, stop_jobs: Callable[[list[str], FinishReason], list[str]],
                 usage: Callable[[], tuple[float, int]] | None = None, advert: Advert | None = None) -> None:
        """`usage`: the worker's CPU seconds and jobs finished so far, stamped on its row at every beat, with its
        `advert` (what it consumes, for the router)."""
        self.sessions, self.settings, self.name, self.leases = sessions, settings, name, leases
        self.stop_jobs, self.usage, self.advert = stop_jobs, usage, advert
        self.sweeper = Sweeper(sessions, celery, settings)
        self._stop = threading.Event()
        self._sweep_due = threading.Event()
        # when the database last answered a beat, and since when it has answered them without a gap (monotonic)
        self._last_beat: float | None = None
        self._answering_since = 0.0
        # The longest gap between beats that no lease can expire in. A live worker renews its leases within two
        # heartbeats of the database's return. It is never under one and a half heartbeats, a beat's own cadence,
        # because a lease that short expires at any late beat whatever this says.
        self._quiet_s = max(settings.dead_after_s - 2 * settings.heartbeat_s, 1.5 * settings.heartbeat_s)
        self._beats = threading.Thread(target=self._beat_loop, name="heartbeat", daemon=True)
        self._sweeps = threading.Thread(target=self._sweep_loop, name="reconciler", daemon=True)

    def start(self) -> Reconciler:
        self.beat()
        self._beats.start()
        self._sweeps.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._sweep_due.set()
        self._beats.join(10)
        # A sweep in progress is not waited for. Each of its chunks is a transaction of its own, and the one it is
        # in when the process ends is rolled back.
        self._sweeps.join(1)

    def beat(self) -> Beat:
        s = self.settings
        held = self.leases.held()
        result = beat(self.sessions, self.name, held, s.dead_after_s, s.sweep_every_s,
                      self.usage() if self.usage is not None else None, self.advert)
        now = time.monotonic()
        if self._last_beat is None or now - self._last_beat > self._quiet_s:  # started, or back from an outage
            self._answering_since = now
        self._last_beat = now
        # A job that finished since the leases were read is not running any more, and one claimed again here
        # since (a stalled engine's job, sent again at once) runs under a new lease. Only runs still going are
        # lost.
        still = self.leases.held()
        lost = [i for i in result.lost if still.get(uuid.UUID(i)) == held[uuid.UUID(i)]]
        if lost := self.stop_jobs(lost, FinishReason.lease_lost):
            log.warning("lost the lease of %d running jobs (handed to another worker meanwhile): stopped", len(lost))
        if result.cancelled:
            self.stop_jobs(result.cancelled, FinishReason.cancelled)
        if result.sweep_due:
            self._sweep_due.set()
        return result

    def settled(self) -> bool:
        """Whether the database has answered this worker's beats without a gap for a full lease (`dead_after_s`).
        Only then does a lease that expired mean that its worker stopped beating, not that the database was away.

        A database outage long enough to expire a lease expires every lease in flight, while their workers live.
        Each of them renews its own at its first beat back (`beat` renews an expired lease while its job still
        runs under it). A sweeper that has seen the database answer for a full lease since has let them, and
        whatever is still expired belongs to a worker that did not beat, dead or frozen. Such an outage leaves a
        gap of over `_quiet_s` in this worker's beats too (a beat that failed, or hung until the database came
        back), which restarts the count. A sweeper that started since cannot tell, and counts from its start. A
        beat that fails now and then (a lost connection) leaves a gap too short to restart anything."""
        now = time.monotonic()
        return (self._last_beat is not None and now - self._last_beat <= self._quiet_s
                and now - self._answering_since >= self.settings.dead_after_s)

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            try:
                self.beat()
            except Exception:  # the database is away, so try again next beat
                log.exception("reconciler heartbeat failed")

    def _sweep_loop(self) -> None:
        while self._sweep_due.wait() and not self._stop.is_set():
            self._sweep_due.clear()
            try:
                self.sweeper.sweep(hand_back=self.settled())
            except Exception:  # the database or broker is away, or the lock was lost; the next turn sweeps again
                log.exception("reconciler sweep failed")
