"""Checkpoint registry settings (REPRISE_* environment variables)."""

from __future__ import annotations

from pydantic_settings import SettingsConfigDict

from reprise_common.settings import DatabaseSettings, ServiceSettings


class RegistrySettings(ServiceSettings, DatabaseSettings):
    """Everything the registry reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="REPRISE_", extra="ignore")

    http_port: int = 8710
    database_url: str = "sqlite:///.state/registry.db"
