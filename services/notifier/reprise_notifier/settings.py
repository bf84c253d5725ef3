"""Notifier settings, read from REPRISE_* environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from reprise_common.auth import AuthSettings
from reprise_common.settings import DatabaseSettings, ServiceSettings
from reprise_notifier.alerts.models import LOUD_KINDS, AlertKind
from reprise_notifier.signing import check_secret


class NotifierSettings(ServiceSettings, DatabaseSettings, AuthSettings):
    """Where alerts go (a routes file and a default route) and how they are paced, retried and given up on."""

    # A validation error must not echo a webhook URL or a secret back into a log.
    model_config = SettingsConfigDict(env_prefix="REPRISE_", extra="ignore", hide_input_in_errors=True)

    http_port: int = Field(default=8740, ge=0, le=65535)
    database_url: str = "sqlite:///.state/notifier.db"
    dashboard_url: str = Field(default="", description="incident links are <dashboard_url>/incidents/<id>; empty: none")
    notifier_routes_file: Path | None = Field(default=None, description="routing rules (YAML, docs/notifier.md)")
    notifier_slack_url: SecretStr | None = Field(
        default=None, description="default route: a Slack incoming webhook, used when no rule of the file matches"
    )
    notifier_webhook_url: SecretStr | None = Field(default=None, description="default route: a signed JSON webhook")
    notifier_webhook_secret: SecretStr | None = Field(default=None, description="the default webhook's HMAC secret")
    notifier_default_kinds: list[AlertKind] = Field(
        default_factory=lambda: list(LOUD_KINDS), description="what the default route sends (JSON list)"
    )
    slack_min_interval_s: float = Field(default=1.0, gt=0, description="at most one message per interval per webhook")
    webhook_min_interval_s: float = Field(default=0.2, gt=0, description="the same for JSON webhooks")
    coalesce_max: int = Field(default=20, ge=1, le=40, description="alerts listed in one coalesced message at most")
    retry_base_s: float = Field(default=1.0, gt=0, description="first backoff after a 5xx or a timeout")
    retry_max_s: float = Field(default=300.0, gt=0, description="the backoff cap")
    max_age_s: float | None = Field(default=None, gt=0, description="dead-letter alerts older than this; none: forever")
    http_timeout_s: float = Field(default=10.0, gt=0, description="per request (connect, write and read each)")
    ack_wait_s: float = Field(default=30.0, gt=0, description="an event not acknowledged by then is redelivered")
    ingest_max_deliver: int = Field(
        default=100, ge=2, description="deliveries of an event the outbox cannot take (database down) before giving up"
    )
    incident_wait_deliveries: int = Field(
        default=3, ge=1, description="a recovery event whose incident is unknown waits this many deliveries for it"
    )
    idle_poll_s: float = Field(default=1.0, gt=0, description="how often an idle worker looks at the outbox")

    @field_validator("notifier_slack_url", "notifier_webhook_url", "notifier_webhook_secret", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("notifier_slack_url", "notifier_webhook_url")
    @classmethod
    def _http_url(cls, value: SecretStr | None) -> SecretStr | None:
        # The message never repeats the URL: it is a secret.
        if value is not None and not value.get_secret_value().startswith(("https://", "http://")):
            raise ValueError("must be an http(s):// URL")
        return value

    @field_validator("dashboard_url")
    @classmethod
    def _dashboard(cls, value: str) -> str:
        if value and not value.startswith(("https://", "http://")):
            raise ValueError("REPRISE_DASHBOARD_URL must be an http(s):// URL or empty")
        return value.rstrip("/")

    @field_validator("notifier_routes_file")
    @classmethod
    def _routes_file_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"REPRISE_NOTIFIER_ROUTES_FILE {value} is not a readable file")
        return value

    @model_validator(mode="after")
    def _webhook_has_secret(self) -> NotifierSettings:
        if self.notifier_webhook_url is not None:
            if self.notifier_webhook_secret is None:
                raise ValueError("REPRISE_NOTIFIER_WEBHOOK_SECRET is required with REPRISE_NOTIFIER_WEBHOOK_URL")
            check_secret("REPRISE_NOTIFIER_WEBHOOK_SECRET", self.notifier_webhook_secret.get_secret_value())
        if self.retry_max_s < self.retry_base_s:
            raise ValueError("retry_max_s must be at least retry_base_s")
        return self
