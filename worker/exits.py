"""What a worker process's exit status says, for its supervisor (`cli.gpus`) and whoever reads its end."""

from __future__ import annotations

import signal

REFUSED = 2  # `convoq worker` refused to start because a check of this machine failed (`cli.doctor`)
ENGINE_DEAD = 3  # the engine died under the worker; its jobs' leases expire and the sweep hands them back
NOT_STARTED = 4  # the engine could not be built, or the database not reached; nothing was consumed

WHY = {
    REFUSED: "it refused to start: a check of this machine failed",
    ENGINE_DEAD: "its engine died",
    NOT_STARTED: "it could not start: its engine could not be built or its database not reached; it consumed nothing",
}


def why(code: int) -> str:
    """A worker's exit status in words (its log says more)."""
    if code < 0:
        return f"it was killed by {signal.Signals(-code).name}"
    return WHY.get(code, f"it exited with status {code}")
