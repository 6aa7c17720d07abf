"""OpenAI's File object, and the answer to deleting one."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class FileOut(BaseModel):
    """OpenAI's File object. A batch's output and error files are files too (`purpose` `batch_output`)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True
