"""Checkpoint registry settings (REPRISE_* environment variables)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from reprise_common.auth import AuthSettings
from reprise_common.settings import DatabaseSettings, ServiceSettings


def default_checkpoint_roots() -> list[Path]:
    """The working directory and the system's temporary directory: where the local stack, the demo and tests write."""
    found = [Path(os.path.realpath(place)) for place in (os.getcwd(), tempfile.gettempdir())]
    return [root for root in dict.fromkeys(found) if root != Path(root.anchor)]


class CheckpointRootsSettings(BaseSettings):
    """Mixin: the directories checkpoints may live in; the registry reads and deletes nothing outside them."""

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


class RegistrySettings(ServiceSettings, DatabaseSettings, AuthSettings, CheckpointRootsSettings):
    """Everything the registry reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="REPRISE_", extra="ignore")

    http_port: int = 8710
    database_url: str = "sqlite:///.state/registry.db"
    consume_agent_events: bool = Field(default=True, description="register checkpoints from agents' events (NATS)")
    validate_sample_fraction: float = Field(
        default=1.0, ge=0.0, le=1.0, description="share of files whose digests are re-verified (1: all)"
    )
    hash_workers: int | None = Field(default=None, ge=1, le=64, description="threads hashing files; none: per core")
    validate_interval_s: float = Field(default=5.0, gt=0, description="how often committed checkpoints are swept")
    reverify_interval_s: float = Field(
        default=600.0, gt=0, le=30 * 86400, description="re-verify a recent validated checkpoint this long after"
    )
    reverify_per_job: int = Field(default=2, ge=0, le=100, description="the newest N validated of each job; 0: none")
    reverify_sample_fraction: float = Field(default=1.0, ge=0.0, le=1.0, description="files re-hashed in a sweep")
    announce_interval_s: float = Field(default=2.0, gt=0)
    retention_keep_last: int = Field(default=3, ge=1)
    retention_keep_every: int = Field(default=0, ge=0, description="also keep every Nth validated; 0: none")
    retention_delete_files: bool = Field(default=False, description="delete an expired checkpoint's files too")
    retention_interval_s: float = Field(default=300.0, gt=0)
    failures_per_node_day: float = Field(
        default=0.005, gt=0, description="advisor's node failure rate when a job has no observed one (5 per 1,000)"
    )
    restart_overhead_s: float = Field(default=300.0, ge=0, description="advisor's detection + recovery + reload")
