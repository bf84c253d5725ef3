"""Checkpoints on the wire: saved by a rank, judged by the registry, and handed to a launch that resumes from one."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field

from reprise_common.checkpoint_names import PATTERN_MAX, CheckpointLayout
from reprise_common.events.base import Event, Wire


class FileDigest(Wire):
    """One checkpoint file's size and digest, computed by the writer while or right after writing it."""

    path: str = Field(min_length=1, max_length=4096)
    size_bytes: int = Field(ge=0)
    digest: str = Field(pattern=r"^[0-9a-f]{16,128}$")
    algorithm: Literal["blake3", "sha256"] = "blake3"


class CheckpointSaved(Event):
    """A rank finished writing its part of a checkpoint: reported through the SDK, or found by its agent (a checkpoint
    the script saves itself, CheckpointWatch)."""

    type: Literal["checkpoint.saved"] = "checkpoint.saved"
    node_id: str
    job_id: str
    rank: int = Field(ge=0)
    step: int = Field(ge=0)
    path: str
    files: list[str] = Field(default_factory=list)
    restart_epoch: int = Field(default=0, ge=0)
    world_size: int | None = Field(default=None, ge=1, description="ranks that write this checkpoint, if known")
    file_digests: list[FileDigest] = Field(
        default_factory=list, description="size and digest of each file, computed where the bytes are"
    )
    marker: str | None = Field(
        default=None,
        min_length=1,
        max_length=255,
        description="the file whose presence commits it, relative to `path`; None: by layout (COMMITTED, .metadata)",
    )


class CheckpointChangeKind(StrEnum):
    """What happened to a checkpoint in the registry."""

    VALIDATED = "validated"
    CORRUPT = "corrupt"
    DELETED = "deleted"


class CheckpointChange(Event):
    """A checkpoint was validated, found corrupt, or deleted by retention."""

    type: Literal["checkpoint.change"] = "checkpoint.change"
    change: CheckpointChangeKind
    checkpoint_id: int = Field(ge=0)
    job_id: str
    step: int = Field(ge=0)
    path: str
    manifest_digest: str | None = None
    reason: str = ""


RESUME_FILES_MAX = 1024  # files a launch carries for the ranks to check; beyond it the registry checks them all


class ResumeFile(Wire):
    """One file of the checkpoint a launch resumes from, as the registry validated it: a rank checks what it loads."""

    path: str = Field(min_length=1, max_length=4096, description="relative to the checkpoint's directory")
    size_bytes: int = Field(ge=0)
    algorithm: Literal["sha256", "blake3"]
    digest: str = Field(pattern=r"^[0-9a-f]{16,128}$")


class CheckpointWatch(Wire):
    """Where a script saves checkpoints of its own (without the SDK): agents find, hash and report the new complete
    ones, and a restore hands the one chosen to the script through its arguments or environment."""

    directory: str = Field(min_length=1, max_length=4096, description="absolute; the checkpoints are its entries")
    layout: CheckpointLayout
    pattern: str = Field(
        min_length=1, max_length=PATTERN_MAX, description="the entries' names: {step}, * and (per_rank) {rank}"
    )
    poll_s: float = Field(default=10.0, ge=0.2, le=600, description="how often an agent looks for new checkpoints")
    restore_args: list[Annotated[str, Field(min_length=1, max_length=1024)]] = Field(
        default_factory=list,
        max_length=16,
        description="appended to the command when a checkpoint is restored, {restore_path} and {restore_step} filled",
    )
    restore_env: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        max_length=256,
        description="an environment variable set to the restored checkpoint's path",
    )
    verify_before_launch: bool = Field(
        default=True,
        description="the agent re-hashes the restored files before it starts a rank (false: the script checks them)",
    )
