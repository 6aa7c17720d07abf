"""SQL statements the service's processes send, counted in the processes themselves.

PostgreSQL counts statements per query only with `pg_stat_statements` preloaded, which a shared server may not
have. Instead the processes a benchmark starts import a `sitecustomize` of ours (put first on their
PYTHONPATH) that counts every cursor execution of every SQLAlchemy engine (`before_cursor_execute`: an
executemany is one, as it is one round trip) and writes its count to a file named after its pid a few times a
second. `total` sums the files: read before and after a burst, the difference is what the burst cost.
`Statements` is the same count for an engine of this process, with the statements themselves.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Engine, event

HOOK = '''
import os, threading, time
from pathlib import Path

from sqlalchemy import event
from sqlalchemy.engine import Engine

_count = [0]
_out = Path(os.environ["CONVOQ_BENCH_STATEMENTS"]) / f"{os.getpid()}.count"
_tmp = _out.with_suffix(".tmp")


@event.listens_for(Engine, "before_cursor_execute")
def _counted(*_args, **_kwargs):
    _count[0] += 1


def _write():
    while True:
        time.sleep(0.1)
        _tmp.write_text(str(_count[0]))
        os.replace(_tmp, _out)  # whole: a reader never sees it half written


threading.Thread(target=_write, name="statement-count", daemon=True).start()
'''


def counting_env(folder: Path) -> dict[str, str]:
    """The environment that makes the processes started with it count their statements into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    hook = folder / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    return {"CONVOQ_BENCH_STATEMENTS": str(folder), "PYTHONPATH": path}


def total(folder: Path) -> int:
    """Statements counted so far by every process that counts into `folder` (a count is at most 0.1 s old)."""
    return sum(int(f.read_text()) for f in folder.glob("*.count"))


class Statements:
    """The SQL statements an engine of this process sends, as they are sent (an executemany is one)."""

    def __init__(self, engine: Engine) -> None:
        self.sent: list[str] = []
        event.listen(engine, "before_cursor_execute", self._sent)

    def _sent(self, _conn, _cursor, statement: str, *_) -> None:
        self.sent.append(statement)

    def take(self) -> list[str]:
        """The statements sent since the last take."""
        sent, self.sent = self.sent, []
        return sent
