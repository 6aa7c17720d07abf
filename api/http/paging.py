"""OpenAI's list paging (`after` an id, `limit`) over rows ordered by (created_at, id).

A keyset, not an offset: a page costs the same however deep it is, and rows added meanwhile shift nothing.
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException, status
from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import Session

from api.schemas.lists import ListOf


def page(session: Session, rows: Select, table: Any, after: object | None, limit: int,
         newest_first: bool = True) -> tuple[list, bool]:
    """Up to `limit` rows of `rows` (a select of `table`, which has `created_at` and `id`) that come after the
    row whose id is `after`, and whether more follow. An `after` that names no row of this list is a 404, the same
    whether the row is another tenant's or none at all: the cursor is looked up among `rows`, never the table."""
    if after is not None:
        # PostgreSQL text cannot hold NUL: no id has one, and the query would fail
        cursor = None if isinstance(after, str) and "\x00" in after else session.execute(
            rows.with_only_columns(table.created_at, table.id).where(table.id == after)).one_or_none()
        if cursor is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"after={after} names nothing in this list")
        at, last = cursor
        beyond = (table.created_at < at) if newest_first else (table.created_at > at)
        tie = (table.id < last) if newest_first else (table.id > last)
        rows = rows.where(or_(beyond, and_(table.created_at == at, tie)))
    order = (table.created_at.desc(), table.id.desc()) if newest_first else (table.created_at, table.id)
    found = list(session.scalars(rows.order_by(*order).limit(limit + 1)))
    return found[:limit], len(found) > limit


def list_of(items: list, has_more: bool = False) -> ListOf:
    return ListOf(data=items, first_id=str(items[0].id) if items else None,
                  last_id=str(items[-1].id) if items else None, has_more=has_more)
