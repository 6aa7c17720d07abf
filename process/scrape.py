"""What a Prometheus scrape of an API or a worker process reads, and where it is served.

A scrape needs no key by default and anyone inside the network may send a flood of them: so what costs a
command (the broker's lists, the database's counts, the engine's stats, the kernel's count of each thread's CPU)
is collected by one background thread of the process at most every `CONVOQ_METRICS_REFRESH_S` (`Snapshot`),
and a scrape reads the last figures it collected, whatever the number of scrapes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)
# processes on one host that share a metrics port setting (a worker per GPU, an API's processes) each take the
# first free port from there, so Prometheus scrapes a known range (base .. base + PORT_TRIES - 1) on every host
PORT_TRIES = 64


class Snapshot(Collector):
    """The figures of `collectors`, collected together by one daemon thread every `every_s` seconds (`start`);
    `collect` answers the last ones at once. A collector that raises is left out of that round, logged, so the
    others still report."""

    def __init__(self, collectors: Iterable[Collector], every_s: float, name: str = "metrics") -> None:
        self.collectors = list(collectors)
        self.every_s = every_s
        self.name = name
        self._families: list[Metric] = []
        self._lock = threading.Lock()  # one collection at a time: a refresh asked for while the thread collects
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Snapshot:
        """The collecting thread; again after `close` (an app's lifespan may run more than once)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self._stop,), name=self.name, daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def refresh(self) -> None:
        """Collect every figure now (the thread does, every `every_s`)."""
        with self._lock:
            families: list[Metric] = []
            for collector in self.collectors:
                try:
                    families.extend(collector.collect())
                except Exception:
                    log.exception("metrics: %s failed; its figures are left out", type(collector).__name__)
            self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)

    def _run(self, stop: threading.Event) -> None:
        while True:
            self.refresh()
            if stop.wait(self.every_s):
                return


def serve(registry: Collector, port: int, what: str, tries: int = PORT_TRIES) -> tuple[int, WSGIServer] | None:
    """`registry` served over HTTP on `port`, or on the first free one of the next `tries - 1` when other processes
    on the host hold it; (port, server), or None when every one is taken (logged: it must not keep the process
    from its work)."""
    for candidate in range(port, min(port + tries, 65536)):
        try:
            server, _ = start_http_server(candidate, registry=registry)
        except OSError:
            continue
        log.info("%s metrics served on port %d", what, candidate)
        return candidate, server
    log.error("%s metrics not served: ports %d-%d are all taken", what, port, port + tries - 1)
    return None
