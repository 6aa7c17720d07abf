"""OpenAI's Model object."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class ModelOut(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "convoq"
