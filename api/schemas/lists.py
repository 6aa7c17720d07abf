"""OpenAI's list object."""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

from pydantic import BaseModel

T = TypeVar("T")


class ListOf(BaseModel, Generic[T]):
    """OpenAI's list object; `after` (an id) and `limit` page through it."""

    object: Literal["list"] = "list"
    data: list[T]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
