"""Detector settings, read from REPRISE_* environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from reprise_common.auth import AuthSettings
from reprise_common.settings import DatabaseSettings, ServiceSettings


class DetectorSettings(ServiceSettings, DatabaseSettings, AuthSettings):
    """Where the detector listens and stores incidents, and how it groups symptoms into incidents."""

    model_config = SettingsConfigDict(env_prefix="REPRISE_", extra="ignore")

    http_port: int = Field(default=8720, ge=0, le=65535)
    incident_window_s: float = Field(
        default=60.0,
        gt=0,
        description="symptoms for a job within this many seconds of an open incident update it, not open a new one",
    )
    event_clock_skew_s: float = Field(
        default=1.0,
        ge=0,
        description="an agent event's time is bounded by when the stream stored it: never later, and at most this "
        "many seconds earlier (an agent's clock is trusted only that far)",
    )
    early_exit_grace_s: float = Field(
        default=15.0,
        gt=0,
        description="a rank that exits 0 opens an incident unless every rank of its launch exits 0 within this long "
        "(or the job is stopped or relaunched)",
    )
    rules_path: Path | None = Field(
        default=None, description="an operator's rules file (YAML) that extends or overrides the built-in rules"
    )

    node_lost_after_s: float = Field(
        default=5.0, gt=0, description="a node that has reported is lost after this many seconds without a report"
    )
    node_lost_peer_factor: float = Field(
        default=1.5,
        gt=1,
        le=100,
        description="a node silent for this many of its report intervals is lost at once when a rank of one of its "
        "jobs failed naming a failed peer (a connection reset, a gloo or NCCL error)",
    )
    node_keys_file: Path | None = Field(
        default=None,
        description="the agents' public NATS keys → node ids (`reprise creds` writes credentials/node-keys.json); "
        "with it, an agent's closed connection is seen at once (the server's client advisories), without it only "
        "missing reports show a lost node",
    )
    reconnect_grace_s: float = Field(
        default=0.3,
        gt=0,
        le=60,
        description="a node whose agent's connection closed is lost unless the agent connects or reports again "
        "within this many seconds",
    )
    node_witness_window_s: float = Field(
        default=1.5,
        gt=0,
        le=600,
        description="a suspect node's jobs' ranks on other nodes that have not advanced for this long (plus 2 of the "
        "job's median steps) after advancing until it fell silent show it gone; advancing since, alive",
    )
    node_unreachable_after_s: float = Field(
        default=30.0,
        gt=0,
        le=86400,
        description="a node silent this long while its jobs' ranks on other nodes advance is said unreachable, once "
        "(a warning incident, never a recovery)",
    )
    node_hold_max_s: float = Field(
        default=300.0,
        gt=0,
        le=86400,
        description="a silent node is vouched for by its jobs' advancing ranks at most this long; then its silence "
        "makes it lost as any node's (jobs whose ranks do not need each other must not hide a dead node for ever)",
    )
    watch_interval_s: float = Field(default=0.5, gt=0, description="how often node loss is checked")
    hang_check_interval_s: float = Field(
        default=0.5,
        gt=0,
        description="how often hangs are checked (a pass costs O(jobs); a job's ranks are looked at "
        "closely only once one can have passed its limit)",
    )
    hang_floor_s: float = Field(
        default=15.0, gt=0, le=86400, description="a training job never counts as hung sooner than this"
    )
    hang_k: float = Field(
        default=3.0, gt=0, le=1000, description="hung after k x the job's rolling p99 step time (or the floor)"
    )
    hang_startup_s: float = Field(
        default=900.0, gt=0, le=86400, description="the limit for ranks still in the startup phase"
    )
    hang_checkpointing_s: float = Field(
        default=1800.0, gt=0, le=86400, description="the limit while a rank is checkpointing"
    )
    hang_evaluating_s: float = Field(
        default=1800.0, gt=0, le=86400, description="the limit while a rank evaluates (phase eval, validation, ...)"
    )
    hang_loading_data_s: float = Field(
        default=900.0, gt=0, le=86400, description="the limit while a rank loads data (phase data_loading, ...)"
    )
    hang_stepless_s: float = Field(
        default=120.0,
        gt=0,
        le=86400,
        description="a job whose ranks report no steps (no SDK): hung when every rank has stood idle at the same stack "
        "this long, one in a torch.distributed call (the agents' stack samples; the job's timeout_s if set)",
    )
    hang_stepless_grace_s: float = Field(
        default=300.0,
        ge=0,
        le=3600,
        description="how long a rank that reports no steps is timed by the startup limit before its stack samples",
    )
    straggler_factor: float = Field(default=1.5, gt=1, description="a rank this many times the job median is slow")
    straggler_reports: int = Field(
        default=5, ge=1, description="slow reports in a row before a straggler warning (counted between folds)"
    )
    reputation_xid: int = Field(default=48, ge=0, description="the XID whose repeats on one node recommend quarantine")
    reputation_xid_count: int = Field(default=2, ge=1, description="that many of reputation_xid within the window")
    reputation_jobs: int = Field(default=3, ge=1, description="hardware faults in this many different jobs")
    reputation_numeric_count: int = Field(
        default=3, ge=1, le=1000, description="numeric faults led from one node within the window"
    )
    reputation_window_s: float = Field(default=86400.0, gt=0, description="the window the reputation rules count in")
    partition_count: int = Field(default=1, ge=1, le=64, description="detector replicas sharing the load")
    partition_index: int = Field(default=0, ge=0, description="this replica's partition, 0..partition_count-1")
    event_batch: int = Field(default=2048, ge=1, le=4096, description="agent events handled in one transaction")
    report_batch: int = Field(
        default=512, ge=1, le=8192, description="node reports handed over at once (sooner when this many wait)"
    )
    report_linger_s: float = Field(
        default=0.005, gt=0, le=0.1, description="how long a report waits for others to join its batch"
    )

    @model_validator(mode="after")
    def _partition_in_range(self) -> DetectorSettings:
        if self.partition_index >= self.partition_count:
            raise ValueError(f"partition_index {self.partition_index} must be below partition_count")
        return self

    @field_validator("rules_path")
    @classmethod
    def _rules_file_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"REPRISE_RULES_PATH {value} is not a readable file")
        return value
