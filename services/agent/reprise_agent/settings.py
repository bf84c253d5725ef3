"""Agent settings (REPRISE_* environment variables)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from reprise_common.settings import IdStr, ServiceSettings


class AgentSettings(ServiceSettings):
    """Everything one node's agent reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="REPRISE_", extra="ignore")

    node_id: IdStr
    http_port: int = 8800
    gpu_backend: Literal["sim"] = "sim"
    gpu_count: int = Field(default=8, ge=0, le=64, description="simulated GPUs (sim backend only)")
    spare: bool = False
    advertise_addr: str = Field(
        default="127.0.0.1", min_length=1, description="where other nodes reach this one (rendezvous master)"
    )
    report_interval_s: float = Field(default=1.0, gt=0)
    gpu_poll_interval_s: float = Field(default=0.1, gt=0)
    stop_grace_s: float = Field(default=10.0, gt=0)
    log_tail_lines: int = Field(default=50, ge=1, le=1000)
    outbox_capacity: int = Field(default=10_000, ge=10)
