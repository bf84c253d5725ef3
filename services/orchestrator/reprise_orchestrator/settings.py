"""Orchestrator settings (REPRISE_* environment variables)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, StringConstraints, field_validator
from pydantic_settings import SettingsConfigDict

from reprise_common.auth import AuthSettings, strong_key
from reprise_common.labels import LabelKey, check_value
from reprise_common.settings import CheckpointRootsSettings, DatabaseSettings, ServiceSettings

# Kubernetes' own spelling (a DNS-1123 label; a DNS-1123 subdomain), as compute/kubernetes/models.py checks a job's.
KubeNamespace = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")]
KubeServiceAccount = Annotated[
    str, StringConstraints(max_length=253, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
]
ANY_LABEL_VALUE = "*"


class OrchestratorSettings(ServiceSettings, DatabaseSettings, AuthSettings, CheckpointRootsSettings):
    """Everything an orchestrator replica reads from its environment."""

    # hide_input_in_errors: a refused REPRISE_ADMIN_API_KEY must not be echoed into logs by the validation error.
    model_config = SettingsConfigDict(env_prefix="REPRISE_", extra="ignore", hide_input_in_errors=True)

    http_port: int = 8730
    database_url: str = "sqlite:///.state/orchestrator.db"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_username: str | None = Field(default=None, max_length=100, description="the Redis ACL user; none: default")
    redis_password: SecretStr | None = Field(default=None, description="that user's password; none: no AUTH")
    registry_url: str = "http://127.0.0.1:8710"
    replica_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    lock_ttl_s: float = Field(default=15.0, gt=0, description="job lock lease; renewed every third of it")
    command_timeout_s: float = Field(default=15.0, gt=0)
    stop_grace_s: float = Field(default=5.0, gt=0)
    in_place_limit_s: float = Field(
        default=5.0,
        gt=0,
        le=600,
        description="a rank asked to restart in place that has not parked within this is stopped and replaced cold",
    )
    stack_capture_s: float = Field(
        default=2.0, gt=0, le=10, description="how long a stop for a hang may wait for the ranks' stacks first"
    )
    standby_spares: int = Field(
        default=2,
        ge=0,
        le=64,
        description="how many of the pool's spares keep standby containers of each containerized job: the ones a"
        " recovery takes first",
    )
    node_stale_s: float = Field(default=5.0, gt=0, description="a node without a report for this long is not placeable")
    master_port_base: int = Field(
        default=29500, ge=1024, le=64535, description="rendezvous ports are drawn from this and the 999 above it"
    )
    http_timeout_s: float = Field(default=5.0, gt=0)
    reconcile_interval_s: float = Field(default=1.0, gt=0, description="how often orphaned recoveries are looked for")
    max_concurrent_recoveries: int = Field(
        default=256,
        ge=1,
        le=10_000,
        description="recoveries one replica runs side by side; beyond it, incidents wait for this or another replica",
    )
    compute_backend: str = Field(
        default="agents",
        min_length=1,
        max_length=200,
        description="what runs the ranks: a built-in backend (agents, slurm, kubernetes) or a factory as "
        "package.module:callable",
    )
    slurm_conf: Path | None = Field(
        default=None, description="the slurm backend's slurm.conf (SLURM_CONF of each Slurm command); none: Slurm's own"
    )
    slurm_command_timeout_s: float = Field(
        default=10.0, gt=0, le=120, description="how long a Slurm command may take before the controller counts as gone"
    )
    slurm_poll_interval_s: float = Field(
        default=2.0, ge=0.1, le=60, description="how often the slurm backend reads Slurm's nodes and jobs"
    )
    slurm_partition: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="the partition Reprise's allocations run in (only its jobs are signalled or cancelled); none: any",
    )
    slurm_agent_command: str = Field(
        default="reprise-agent",
        min_length=1,
        max_length=4096,
        description="how a Slurm node starts Reprise's agent (a path, or a command on the batch job's PATH)",
    )
    slurm_agent_nats_url: str | None = Field(
        default=None, max_length=4096, description="where agents in an allocation reach NATS; none: this replica's URL"
    )
    slurm_agent_creds_dir: Path | None = Field(
        default=None,
        description="a directory the Slurm nodes see holding each node's NATS seed (<node>.nk, as `reprise creds` "
        "writes them); none: agents connect without one",
    )
    slurm_agent_http_port: int = Field(
        default=8800, ge=0, le=65000, description="an agent's HTTP port: this plus its node's index; 0: any free one"
    )
    slurm_agent_env: dict[str, str] = Field(
        default_factory=dict, description="further settings of the agents in an allocation (JSON), e.g. GPU backend"
    )
    slurm_agent_start_timeout_s: float = Field(
        default=180.0,
        gt=0,
        le=3600,
        description="how long a pending job's allocation may run before its workers' agents report; then it fails",
    )
    kubernetes_namespaces: list[KubeNamespace] = Field(
        default_factory=lambda: ["reprise-jobs"],
        max_length=256,
        description="namespaces a job's `kubernetes` section may name (the backend's Role must be bound in each)",
    )
    kubernetes_node_selectors: dict[LabelKey, list[str]] = Field(
        default_factory=dict,
        max_length=64,
        description='node-selector keys a job may use, each with its allowed values ("*": any), as JSON; none: no key',
    )
    kubernetes_service_accounts: list[KubeServiceAccount] = Field(
        default_factory=lambda: ["reprise-agent"],
        max_length=256,
        description="service accounts a job's pods may run as",
    )
    kubernetes_api_url: str | None = Field(
        default=None,
        max_length=2048,
        pattern=r"^https?://",
        description="the kubernetes backend's API server (https://host:port); none: the in-cluster one (the pod's "
        "KUBERNETES_SERVICE_HOST and _PORT)",
    )
    kubernetes_token_file: Path = Field(
        default=Path("/var/run/secrets/kubernetes.io/serviceaccount/token"),
        description="the bearer token the kubernetes backend presents (its ServiceAccount's), read at start",
    )
    kubernetes_ca_file: Path | None = Field(
        default=Path("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"),
        description="the CA that signed the API server's certificate; none: the system's CAs",
    )
    kubernetes_node_selector: str | None = Field(
        default="reprise.dev/role in (worker,spare)",
        max_length=1024,
        description="the label selector of the nodes labelled for training (the only ones watched and allocated)",
    )
    kubernetes_request_timeout_s: float = Field(
        default=10.0, gt=0, le=120, description="how long one request to the API server may take"
    )
    kubernetes_jobs_namespace: KubeNamespace = Field(
        default="reprise-jobs",
        description="the namespace of a job's pods when its `kubernetes` section names none (one of the allowed)",
    )
    kubernetes_agent_image: str = Field(
        default="reprise-agent:local",
        min_length=1,
        max_length=1024,
        description="the image of the jobs' agent pods (their command and settings are REPRISE_SLURM_AGENT_*)",
    )
    kubernetes_agent_seeds_secret: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$",
        description="a Secret holding each node's NATS seed (<node>.nk): each pod mounts its own node's alone, at "
        "REPRISE_SLURM_AGENT_CREDS_DIR; none: nothing mounted",
    )
    read_api_key: SecretStr | None = Field(
        default=None, description="a read-only key that exists at start, named bootstrap-read (e.g. the dashboard's)"
    )
    registry_api_key: SecretStr | None = Field(
        default=None, description="the key this replica presents to the registry (operate); none: the admin key"
    )

    @field_validator("kubernetes_node_selectors")
    @classmethod
    def _label_values(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for values in value.values():
            for allowed in values:
                if allowed != ANY_LABEL_VALUE:
                    check_value(allowed)
        return value

    @field_validator("read_api_key", "registry_api_key")
    @classmethod
    def _strong_keys(cls, value: SecretStr | None) -> SecretStr | None:
        return strong_key(value, "REPRISE_READ_API_KEY / REPRISE_REGISTRY_API_KEY")
