"""Orchestrator settings (REPRISE_* environment variables)."""

from __future__ import annotations

import os
import socket

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from reprise_common.settings import DatabaseSettings, ServiceSettings


class OrchestratorSettings(ServiceSettings, DatabaseSettings):
    """Everything an orchestrator replica reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="REPRISE_", extra="ignore")

    http_port: int = 8730
    database_url: str = "sqlite:///.state/orchestrator.db"
    redis_url: str = "redis://127.0.0.1:6379/0"
    registry_url: str = "http://127.0.0.1:8710"
    replica_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    lock_ttl_s: float = Field(default=15.0, gt=0, description="job lock lease; renewed every third of it")
    command_timeout_s: float = Field(default=15.0, gt=0)
    stop_grace_s: float = Field(default=5.0, gt=0)
    node_stale_s: float = Field(default=5.0, gt=0, description="a node without a report for this long is not placeable")
    master_port_base: int = Field(default=29500, ge=1024, le=65000)
    http_timeout_s: float = Field(default=5.0, gt=0)
