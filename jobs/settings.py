"""Every setting of the service, read once from the environment (prefix `CONVOQ_`) or a `.env` file."""

from __future__ import annotations

import hashlib
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DATA_DIR = Path(".convoq")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CONVOQ_", env_file=".env", extra="ignore")

    database_url: str = f"sqlite:///{DATA_DIR}/convoq.db"
    broker_url: str = "redis://127.0.0.1:6379/0"
    # An HF model folder or hub id; the default is the tiny random checkpoint `convoq tiny-model` writes.
    model: str = str(DATA_DIR / "models" / "tiny")
    backend: Literal["hf", "engine"] = "hf"
    device: str = "auto"  # auto = cuda when available
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_batch_size: int = Field(16, ge=1, le=1024)

    # Comma-separated plain keys (hashed as soon as they are read; only hashes are kept).
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list)

    interactive_queue: str = "convoq.interactive"
    bulk_queue: str = "convoq.bulk"
    # Seconds a delivered but unacknowledged message stays invisible before Redis hands it out again:
    # longer than the longest queue wait plus run time, or long jobs would run twice.
    visibility_timeout: int = Field(4 * 3600, ge=60)
    worker_concurrency: int = Field(64, ge=1, le=1024)  # Celery threads feeding one engine

    max_upload_bytes: int = Field(100 * 2**20, ge=1)  # one batch upload
    max_wait_seconds: float = Field(60.0, ge=0)

    flower_port: int = 5555
    flower_user: str = "admin"
    flower_password: SecretStr = SecretStr("")  # `convoq flower` refuses to start without one

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [k.strip() for k in value.split(",") if k.strip()]
        return value

    @cached_property
    def api_key_hashes(self) -> frozenset[str]:
        return frozenset(hash_key(k.get_secret_value()) for k in self.api_keys)


def get_settings() -> Settings:
    return Settings()
