"""The garbage collector in a long-lived process of the service.

A worker or an API process holds a large heap that lives as long as it does: the libraries it imported,
the tokenizer, Celery's and SQLAlchemy's state, a few hundred thousand objects in all. CPython's oldest
generation is collected every so often whatever it holds, and each such collection walks all of them: a worker
running short jobs paid about a quarter of a second every thousand jobs, every thread of the process stopped
meanwhile (an urgent chat's tokens too). Those objects are never garbage, so once started, the process collects
what its start left behind and moves the rest out of the collector's sight (`gc.freeze`); the collector still
sees, and collects, everything allocated afterwards.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Called once the process has started: collects the start's garbage, then exempts every object still
    alive from later collections. Returns how many objects that is."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
