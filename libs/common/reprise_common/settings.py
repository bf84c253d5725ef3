"""The one settings pattern: a pydantic-settings class per service, all read from REPRISE_* variables."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

NODE_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class ServiceSettings(BaseSettings):
    """Settings every service shares; each service subclasses it and adds its own."""

    model_config = SettingsConfigDict(env_prefix="REPRISE_", extra="ignore")

    nats_url: str = Field(
        default="nats://127.0.0.1:4222", description="a NATS server, or a cluster's members comma-separated"
    )
    nats_stream_replicas: int = Field(
        default=1, ge=1, le=5, description="servers of a NATS cluster holding each stream (3 in production)"
    )
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=8000, ge=0, le=65535)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["json", "text"] = "json"
    state_dir: Path = Path(".state")
    nats_nkey_seed_file: Path | None = Field(
        default=None, description="NKey seed file of this service's NATS identity (`reprise creds`); none: no auth"
    )
    shutdown_grace_s: float = Field(default=10.0, gt=0)
    http_keep_alive_s: float = Field(
        default=30.0,
        ge=1,
        le=600,
        description="an idle HTTP connection is closed after this long: longer than clients keep theirs idle "
        "(httpx: 5 s), so no client sends on a connection the server is closing",
    )

    @field_validator("nats_url")
    @classmethod
    def _nats_scheme(cls, value: str) -> str:
        for server in value.split(","):
            if not server.strip().startswith(("nats://", "tls://", "ws://", "wss://")):
                raise ValueError("REPRISE_NATS_URL: each server must start with nats://, tls://, ws:// or wss://")
        return value


class DatabaseSettings(BaseSettings):
    """Mixin for services that keep state in SQL: SQLite by default, PostgreSQL at scale."""

    model_config = SettingsConfigDict(env_prefix="REPRISE_", extra="ignore")

    database_url: str = "sqlite:///.state/reprise.db"

    @field_validator("database_url")
    @classmethod
    def _known_dialect(cls, value: str) -> str:
        if not value.startswith(("sqlite:///", "postgresql://", "postgresql+psycopg://")):
            raise ValueError("REPRISE_DATABASE_URL must be sqlite:///PATH or postgresql+psycopg://...")
        return value


def default_checkpoint_roots() -> list[Path]:
    """The working directory and the system's temporary directory: where the local stack, the demo and tests write."""
    found = [Path(os.path.realpath(place)) for place in (os.getcwd(), tempfile.gettempdir())]
    return [root for root in dict.fromkeys(found) if root != Path(root.anchor)]


class CheckpointRootsSettings(BaseSettings):
    """Mixin: the directories checkpoints may live in; the registry reads and deletes nothing outside them, and the
    orchestrator refuses a job whose own checkpoints would lie elsewhere."""

    model_config = SettingsConfigDict(env_prefix="REPRISE_", extra="ignore")

    checkpoint_roots: list[Path] = Field(
        default_factory=default_checkpoint_roots,
        min_length=1,
        description="JSON list of absolute directories; each checkpoint's directory must resolve inside one of them",
    )

    @field_validator("checkpoint_roots")
    @classmethod
    def _absolute_and_resolved(cls, roots: list[Path]) -> list[Path]:
        resolved = []
        for root in roots:
            if not root.is_absolute():
                raise ValueError(f"REPRISE_CHECKPOINT_ROOTS: {root} is not an absolute directory")
            real = Path(os.path.realpath(root))  # resolved once at start: a symlinked root counts where it points
            if real == Path(real.anchor):
                raise ValueError("REPRISE_CHECKPOINT_ROOTS: / would confine nothing; name the checkpoint directories")
            resolved.append(real)
        return list(dict.fromkeys(resolved))


# Ids that travel in NATS subjects (nodes, jobs) must be one safe subject token.
IdStr = Annotated[str, StringConstraints(pattern=NODE_ID_PATTERN, min_length=1, max_length=64)]
