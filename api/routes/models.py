"""`/v1/models`: the model the fleet serves (CONVOQ_MODEL), as OpenAI's Model objects."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, status

from api.http.deps import V1_ERRORS, Caller, SettingsDep, errors
from api.schemas.lists import ListOf
from api.schemas.models import ModelOut
from jobs.settings import Settings

router = APIRouter(prefix="/v1/models", tags=["models"], responses=V1_ERRORS)

SERVING_SINCE = int(time.time())  # `created`: a model folder or hub id has no creation time of its own


def served(settings: Settings) -> ModelOut:
    return ModelOut(id=settings.model, created=SERVING_SINCE)


@router.get("", response_model=ListOf[ModelOut])
def list_models(settings: SettingsDep, _: Caller) -> ListOf[ModelOut]:
    return ListOf(data=[served(settings)])


# `:path`: hub ids have a slash (Qwen/Qwen3-8B), which the `openai` SDK sends as %2F
@router.get("/{model_id:path}", response_model=ModelOut, responses=errors(e404="Not the served model"))
def get_model(model_id: Annotated[str, Path(pattern=r"^[A-Za-z0-9_.:/-]{1,256}$")], settings: SettingsDep,
              _: Caller) -> ModelOut:
    if model_id != settings.model:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no model {model_id!r}; this service runs {settings.model!r}")
    return served(settings)
