"""Agent settings (REPRISE_* environment variables)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from reprise_agent.depchecks.specs import DependencyChecks
from reprise_agent.launch.container_group import DEFAULT_GID
from reprise_common.settings import IdStr, ServiceSettings


class AgentSettings(ServiceSettings):
    """Everything one node's agent reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="REPRISE_", extra="ignore")

    node_id: IdStr
    http_port: int = 8800
    gpu_backend: Literal["sim", "nvml"] = "sim"
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
    sdk_socket: Path | None = Field(
        default=None,
        description="the training SDK's Unix datagram socket, given to ranks as REPRISE_SDK_SOCKET "
        "(default <state_dir>/sdk.sock, or a short path in the temp dir when that exceeds 107 bytes)",
    )
    dependency_checks: DependencyChecks = Field(
        default_factory=list,
        description='JSON list, e.g. [{"kind": "storage", "path": "/ckpt"}, {"kind": "disk", "path": "/", '
        '"min_free_fraction": 0.05}]',
    )
    dependency_interval_s: float = Field(default=5.0, gt=0)
    dependency_repeat_s: float = Field(default=60.0, gt=0, description="re-report a lasting failure this often")
    py_spy: Path | None = Field(
        default=None, description="py-spy for the stacks of hung ranks (default: beside the interpreter, or on PATH)"
    )
    stack_sample_s: float = Field(
        default=10.0,
        ge=0,
        le=600,
        description="how often the main-thread stack of a rank that reports no steps (no SDK) is sampled with py-spy, "
        "for hangs without heartbeats (0: never)",
    )
    rendezvous_grace_s: float = Field(
        default=30.0, ge=0, description="how long a new rendezvous master may take to listen"
    )
    standbys: int = Field(
        default=0, ge=0, le=64, description="warm standby interpreters kept ready for replacement ranks (0: none)"
    )
    container_standbys: int | None = Field(
        default=None,
        ge=0,
        le=64,
        description="standby containers kept ready per containerized job, never more than its ranks here (0: none; "
        "None: as many as REPRISE_STANDBYS); a node that runs only containers sets REPRISE_STANDBYS=0 and this",
    )
    standby_python: Path = Field(
        default=Path(sys.executable), description="the interpreter of the standbys: jobs must run this one to use them"
    )
    standby_refill_delay_s: float = Field(
        default=10.0,
        ge=0,
        le=3600,
        description="how long after ranks took standbys new ones start importing (not beside the ranks' own start)",
    )
    docker_url: str | None = Field(
        default=None,
        description="the Docker daemon that runs the ranks of jobs with a container image (e.g. "
        "unix:///var/run/docker.sock); None: such jobs are refused here (docs/containers.md)",
    )
    container_mount_roots: list[Path] = Field(
        default_factory=list, max_length=64, description="host paths a job's containers may mount from (JSON list)"
    )
    container_gid: int = Field(
        default=DEFAULT_GID,
        ge=1,
        le=2**31 - 2,
        description="the group every rank's container runs in beside its user: the agent gives it what it makes for "
        "the ranks (inbox, output, the SDK socket), so that ranks of users other than root use them; no host user "
        "should be in it (docs/containers.md)",
    )
    container_images: list[str] | None = Field(
        default=None, max_length=1024, description="the images a job may name (JSON list); None: any local image"
    )
    standby_preload: list[str] = Field(
        default_factory=lambda: ["torch", "torch.distributed", "torch._dynamo"],
        max_length=64,
        description="modules a standby imports before it waits (JSON list)",
    )
