"""Checkpoint registry settings (REPRISE_* environment variables)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from reprise_common.auth import AuthSettings
from reprise_common.settings import CheckpointRootsSettings, DatabaseSettings, ServiceSettings


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
