"""The values Slurm's commands take and give, typed and validated: node and job as Slurm sees them, a job's state, and
a batch submission (sbatch's options). A name is one node, partition or account, never a list or an option; a text
(a reason, a job name) is one line Slurm can show; an extra sbatch option is one `--name[=value]` token Reprise does
not set itself. The adapter that runs the commands is cli.py.
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # one node (partition, account): never a list or an option
_TEXT_MAX = 255  # a reason or a job name: what `sinfo -R` and `squeue` can show
_EXTRA_OPTION = re.compile(r"--[a-z][a-z0-9-]*(=.*)?", re.DOTALL)
_OWN_SBATCH_OPTIONS = {"--parsable", "--wrap", "--job-name", "--nodes", "--ntasks-per-node", "--output"} | {
    "--partition",
    "--account",
    "--time",
    "--exclude",
    "--nodelist",
    "--requeue",
    "--no-requeue",
    "--export",
    "--ntasks",
    "--array",
    "--no-kill",
    "--kill-command",
}


def _name(value: str) -> str:
    if not _NAME.fullmatch(value):
        raise ValueError(f"not a Slurm name (node, partition, account): {value!r}")
    return value


def plain_text(value: str) -> str:
    """A reason or a job name, or ValueError: non-empty, on one line, no control characters, at most 255 characters."""
    if not value.strip() or len(value) > _TEXT_MAX or any(ord(char) < 32 or ord(char) == 127 for char in value):
        raise ValueError(f"must be non-empty text on one line (at most {_TEXT_MAX} characters, no control characters)")
    return value


SlurmName = Annotated[str, AfterValidator(_name)]
PlainText = Annotated[str, AfterValidator(plain_text)]


class SlurmJobState(StrEnum):
    """A job's state as Slurm names it (22.05's job_state_string: the base states, then the flags it shows first)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    COMPLETING = "COMPLETING"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    CONFIGURING = "CONFIGURING"
    RESIZING = "RESIZING"
    REQUEUED = "REQUEUED"
    REQUEUE_FED = "REQUEUE_FED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    STAGE_OUT = "STAGE_OUT"
    STOPPED = "STOPPED"
    REVOKED = "REVOKED"
    RESV_DEL_HOLD = "RESV_DEL_HOLD"
    SIGNALING = "SIGNALING"
    UNKNOWN = "UNKNOWN"  # a state this adapter does not know (a newer Slurm)


# A node in any of these states takes no new work: drained by anyone, down, not answering, or not there yet.
UNSCHEDULABLE = frozenset(
    {"DOWN", "DRAIN", "NOT_RESPONDING", "FAIL", "MAINTENANCE", "FUTURE", "POWERED_DOWN", "POWERING_DOWN"}
    | {"REBOOT_REQUESTED"}
)


class SlurmNode(BaseModel):
    """A node as Slurm sees it: its base state and flags in one set (upper case), and the reason set on it."""

    model_config = ConfigDict(frozen=True)

    name: str
    state: frozenset[str] = Field(description='e.g. {"IDLE"}, {"ALLOCATED", "DRAIN"}, {"DOWN", "NOT_RESPONDING"}')
    reason: str = ""
    reason_set_by: str | None = None

    @property
    def drained(self) -> bool:
        """Drained or draining (by us or by an admin): Slurm places no new job on it."""
        return "DRAIN" in self.state

    @property
    def down(self) -> bool:
        """Down, or its slurmd does not answer the controller."""
        return bool(self.state & {"DOWN", "NOT_RESPONDING"})

    @property
    def schedulable(self) -> bool:
        """True when Slurm may place work on the node."""
        return not self.state & UNSCHEDULABLE


class SlurmJob(BaseModel):
    """A job as Slurm sees it: its state, the nodes allocated to it (none while pending) and the reason it waits."""

    model_config = ConfigDict(frozen=True)

    job_id: int
    name: str
    state: SlurmJobState
    nodes: tuple[str, ...] = ()
    reason: str = ""
    partition: str = ""
    restart_count: int = Field(0, description="how many times Slurm requeued it")
    excluded_nodes: tuple[str, ...] = ()


class SlurmSubmission(BaseModel):
    """What `sbatch` is given for one allocation: the batch script and its options, every one validated."""

    model_config = ConfigDict(frozen=True)

    name: PlainText
    nodes: int = Field(ge=1)
    script: str = Field(description="the batch script, starting with #!; it runs on the allocation's first node")
    partition: SlurmName | None = None
    account: SlurmName | None = None
    time_limit_min: int | None = Field(None, ge=1)
    exclude: tuple[SlurmName, ...] = ()
    requeue: bool = True
    keep_on_node_failure: bool = Field(
        False, description="--no-kill: a node that fails leaves the allocation, which runs on (Slurm's default ends it)"
    )
    output: Path | None = Field(None, description="the batch step's output file (%j: the job id); Slurm's default")
    extra_args: tuple[str, ...] = Field((), description="further sbatch options from the job spec, each --name=value")

    @field_validator("script")
    @classmethod
    def _shebang(cls, value: str) -> str:
        if not value.startswith("#!"):
            raise ValueError("a batch script starts with #! (sbatch refuses others)")
        return value

    @field_validator("extra_args")
    @classmethod
    def _options_only(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for arg in value:
            sbatch_option(arg)
        return value

    def argv(self) -> list[str]:
        """sbatch's arguments (the script goes on its stdin)."""
        args = ["--parsable", f"--job-name={self.name}", f"--nodes={self.nodes}", "--ntasks-per-node=1"]
        args.append("--requeue" if self.requeue else "--no-requeue")
        if self.keep_on_node_failure:
            args.append("--no-kill")
        if self.partition:
            args.append(f"--partition={self.partition}")
        if self.account:
            args.append(f"--account={self.account}")
        if self.time_limit_min:
            args.append(f"--time={self.time_limit_min}")
        if self.exclude:
            args.append(f"--exclude={','.join(self.exclude)}")
        if self.output:
            args.append(f"--output={self.output}")
        return [*args, *self.extra_args]


def sbatch_option(arg: str) -> str:
    """An extra sbatch option from a job spec: one --name[=value] token on one line, none Reprise sets itself."""
    if not _EXTRA_OPTION.fullmatch(arg) or "\n" in arg:
        raise ValueError(f"an extra sbatch argument must be one --name[=value] token: {arg!r}")
    if arg.split("=", 1)[0] in _OWN_SBATCH_OPTIONS:
        raise ValueError(f"{arg.split('=', 1)[0]} is set by Reprise, not by the job spec")
    return arg


def slurm_name(value: str) -> str:
    """A node, partition or account name, or ValueError: never a list or an option."""
    return _name(value)
