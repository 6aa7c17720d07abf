"""Room for urgent messages. A worker stops fetching bulk messages while bulk jobs hold their share of it.

Every Celery thread of a worker blocks on its job until the engine finishes it, and Redis has no per-queue
prefetch. Without a limit, a bulk batch fills every thread (and every prefetch slot), and an urgent message
then waits in Redis until some bulk job ends. This consumer bootstep counts the bulk jobs the worker holds
(received, not finished; a grouped message counts its lines, which run side by side) and stops consuming the
bulk queues (the shared one and the worker's own) when they reach `share` of the worker's threads, starting again
below it; interactive messages are then fetched within one broker round trip. A group received just below the
limit overshoots it by less than a group (`CONVOQ_BULK_GROUP`), in an engine that batches far more.

All state lives on the consumer's event-loop thread. The count goes up in `task_received` (sent there, from
inside the read that delivered the message, before the next fetch is issued, so the cancel lands before
another bulk message can), and task threads hand their `task_postrun` to it with `call_soon`. A message id
may be delivered again while its first copy still runs (after a reconnect), so deliveries are counted, not
ids.
"""

from __future__ import annotations

import logging
import math
from collections import Counter

from celery import bootsteps, signals
from celery.bootsteps import RUN
from celery.worker import state as worker_state

from jobs.queues import TASK_RUN_GROUP

log = logging.getLogger(__name__)


def bulk_cap(share: float, concurrency: int) -> int:
    """Threads bulk may hold: `share` of them, leaving at least one for urgent work (unless there is one)."""
    return max(1, min(concurrency - 1, math.floor(share * concurrency)))


class BulkGate(bootsteps.StartStopStep):
    requires = ("celery.worker.consumer.tasks:Tasks",)
    queues: tuple[str, ...] = ("convoq.bulk",)  # set by `bulk_gate` to the shared bulk queue and the worker's own
    share = 0.75

    def __init__(self, c, **kwargs) -> None:
        super().__init__(c, **kwargs)
        self.c = c
        self.cap = bulk_cap(self.share, c.controller.concurrency)
        self.held: Counter[str] = Counter()  # task id -> bulk deliveries received and not finished
        self.lines: dict[str, int] = {}  # task id -> the jobs its message carries
        self.holding = 0  # bulk jobs of the deliveries held
        self.gated: list[str] | None = None  # the bulk queues this worker was started on
        signals.task_received.connect(self._received, sender=c, weak=False)
        signals.task_postrun.connect(self._postrun, weak=False)
        signals.task_revoked.connect(self._revoked, weak=False)

    def start(self, c) -> None:  # every (re)connect, after the task consumer exists
        if self.gated is None:
            self.gated = [q for q in self.queues if q in c.app.amqp.queues.consume_from]
            log.info("bulk jobs may hold %d of %d threads", self.cap, c.controller.concurrency)
        # the event loop starts consuming after this, so decide on its first turn
        c.call_soon(self._reconcile)

    # on the event loop's thread
    def _received(self, sender=None, request=None, **_) -> None:
        if request.delivery_info.get("routing_key") in self.queues:
            self.held[request.id] += 1
            self.lines[request.id] = len(request.args[0]) if request.task_name == TASK_RUN_GROUP else 1
            self.holding += self.lines[request.id]
            self._reconcile()

    def _finished(self, task_id: str) -> None:
        if self.held[task_id] > 0:  # a bulk message of ours (any other id reads as 0, and is not stored)
            self.held[task_id] -= 1
            self.holding -= self.lines[task_id]
            if not self.held[task_id]:
                del self.held[task_id], self.lines[task_id]
            self._reconcile()

    def _reconcile(self) -> None:
        c = self.c
        if not self.gated or c.task_consumer is None:
            return
        for queue in self.gated:
            consuming = c.task_consumer.consuming_from(queue)
            if consuming and self.holding >= self.cap:
                c.cancel_task_queue(queue)
            elif (not consuming and self.holding < self.cap and c.blueprint.state == RUN
                  and not worker_state.should_stop and not worker_state.should_terminate):
                c.add_task_queue(queue)

    # on any thread
    def _postrun(self, task_id=None, **_) -> None:
        self.c.call_soon(self._finished, task_id)

    def _revoked(self, request=None, **_) -> None:
        self.c.call_soon(self._finished, request.id)


def bulk_gate(queues: list[str], share: float) -> type[BulkGate]:
    """The gate for a worker's bulk `queues` (shared and its own), letting bulk hold `share` of its threads."""
    return type("BulkGate", (BulkGate,), {"queues": tuple(queues), "share": share})
