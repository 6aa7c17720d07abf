"""A job's priority: an integer from `LOWEST` to `HIGHEST`, the highest the most urgent.

The broker orders messages its own way (`broker.redis_layout.broker_priority`); which priorities are interactive
is `jobs.queues.is_interactive`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

LOWEST, HIGHEST = 0, 9
LEVELS = range(LOWEST, HIGHEST + 1)
Priority = Annotated[int, Field(ge=LOWEST, le=HIGHEST)]
# how the range reads in a field's or an option's help
RANGE = f"{LOWEST}..{HIGHEST}, {HIGHEST} most urgent"

DEFAULT_PRIORITY = 5  # a job submitted on its own
DEFAULT_BATCH_PRIORITY = 1  # bulk work: low, so that chats overtake it
