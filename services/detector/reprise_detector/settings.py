"""Detector settings, read from REPRISE_* environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from reprise_common.settings import DatabaseSettings, ServiceSettings


class DetectorSettings(ServiceSettings, DatabaseSettings):
    """Where the detector listens and stores incidents, and how it groups symptoms into incidents."""

    model_config = SettingsConfigDict(env_prefix="REPRISE_", extra="ignore")

    http_port: int = Field(default=8720, ge=0, le=65535)
    incident_window_s: float = Field(
        default=60.0,
        gt=0,
        description="symptoms for a job within this many seconds of an open incident update it, not open a new one",
    )
    rules_path: Path | None = Field(
        default=None, description="an operator's rules file (YAML) that extends or overrides the built-in rules"
    )

    @field_validator("rules_path")
    @classmethod
    def _rules_file_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"REPRISE_RULES_PATH {value} is not a readable file")
        return value
