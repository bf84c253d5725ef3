"""Dashboard settings, read from REPRISE_* environment variables."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from reprise_common.auth import AuthSettings
from reprise_common.settings import ServiceSettings


class DashboardSettings(ServiceSettings, AuthSettings):
    """Where the services the dashboard reads are, the read key it reads with, who may look, and its timeouts."""

    # A validation error must not echo the API key back into a log.
    model_config = SettingsConfigDict(env_prefix="REPRISE_", extra="ignore", hide_input_in_errors=True)

    http_port: int = Field(default=8760, ge=0, le=65535)
    orchestrator_url: str = Field(default="http://127.0.0.1:8730", description="jobs, recoveries, drills, nodes")
    detector_url: str = Field(default="http://127.0.0.1:8720", description="incidents and node health")
    registry_url: str = Field(default="http://127.0.0.1:8710", description="checkpoints and the advisor")
    notifier_url: str = Field(default="http://127.0.0.1:8740", description="dead letters and destinations")
    read_api_key: SecretStr | None = Field(
        default=None, description="the API key (read scope) the dashboard presents to every service"
    )
    viewer_auth: Literal["key", "proxy", "off"] = Field(
        default="key", description="viewers sign in with an API key, or a reverse proxy vouches, or anyone may look"
    )
    viewer_header: str = Field(
        default="X-Forwarded-User", min_length=1, max_length=100, description="the proxy's user header (proxy mode)"
    )
    http_timeout_s: float = Field(default=3.0, gt=0, description="per call to a service (connect, write, read each)")
    sse_keepalive_s: float = Field(default=15.0, gt=0, description="a comment on idle /events streams this often")
    # /events streams never end by themselves and uvicorn waits this long for open ones before it stops: the
    # dashboard holds no work worth waiting for, so it stops quickly (browsers reconnect on their own).
    shutdown_grace_s: float = Field(default=2.0, gt=0)

    @field_validator("orchestrator_url", "detector_url", "registry_url", "notifier_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must be an http(s):// URL")
        return value.rstrip("/")

    @field_validator("read_api_key", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        return None if value == "" else value
