"""What the demo's scenario plans and records: the faults, each fault's incident and recovery, the whole run."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from reprise_common.events import FaultKind, InjectFault

if TYPE_CHECKING:  # annotations only
    from reprise_cli.demo.sampler import Sample
    from reprise_cli.demo.training import Reference, Training

TERMINAL = frozenset({"running", "failed", "held"})  # the recovery steps that end a recovery


class Fault(StrEnum):
    """The faults the demo injects."""

    RANK_CRASH = "rank crash"  # SIGKILL one rank
    XID79 = "XID 79"  # the rank's GPU falls off the bus: its node is cordoned, a spare takes its place
    RANK_HANG = "rank hang"  # SIGSTOP one rank: alive and silent, its peers blocked in the next collective
    NODE_LOSS = "node loss"  # the node's agent and ranks are killed: no reports, no goodbye
    # A byte of the newest validated checkpoint flipped on storage, then a rank crash: the ranks' load finds the
    # digest changed, the registry marks it corrupt, and the recovery falls back to the checkpoint before it.
    CORRUPT_CHECKPOINT = "corrupt checkpoint"


@dataclass(frozen=True)
class FaultPlan:
    """A fault and the rank it hits (its node and GPU are that rank's at the time)."""

    fault: Fault
    rank: int


def demo_faults(nodes: int) -> list[FaultPlan]:
    """The demo's four faults for a job of `nodes` nodes (one rank each)."""
    last = nodes - 1
    return [
        FaultPlan(Fault.RANK_CRASH, min(1, last)),
        FaultPlan(Fault.XID79, min(2, last)),
        FaultPlan(Fault.RANK_HANG, last),
        FaultPlan(Fault.NODE_LOSS, last),
    ]


def fault_event(plan: FaultPlan, *, job_id: str, gpu: int | None) -> InjectFault:
    """The injection request for a planned fault."""
    if plan.fault is Fault.XID79:
        return InjectFault(kind=FaultKind.XID, gpu=gpu or 0, xid=79)
    kinds = {
        Fault.RANK_CRASH: FaultKind.RANK_KILL,
        Fault.CORRUPT_CHECKPOINT: FaultKind.RANK_KILL,
        Fault.RANK_HANG: FaultKind.RANK_HANG,
    }
    if plan.fault is Fault.NODE_LOSS:
        return InjectFault(kind=FaultKind.NODE_LOSS, job_id=job_id)
    return InjectFault(kind=kinds[plan.fault], rank=plan.rank, job_id=job_id)


@dataclass
class FaultRun:
    """One injected fault and what the platform did about it."""

    plan: FaultPlan
    node_id: str
    epoch: int  # the launch it hit
    injected_at: datetime
    detail: str
    incident: dict[str, Any] | None = None
    recovery: dict[str, Any] | None = None
    slurm: dict[str, Any] = field(default_factory=dict)  # on Slurm: when sinfo showed the fault (s after it), why
    kubernetes: dict[str, Any] = field(default_factory=dict)  # on Kubernetes: the node as the API server had it

    @property
    def recovered(self) -> bool:
        """The recovery ended with the job running again."""
        return self.recovery is not None and self.recovery.get("outcome") == "recovered"

    def step(self, name: str) -> dict[str, Any] | None:
        """The last record of a recovery step (a retried attempt repeats steps)."""
        steps = (self.recovery or {}).get("steps", [])
        return next((s for s in reversed(steps) if s["step"] == name), None)

    @property
    def resumed(self) -> dict[str, Any]:
        """Where the ranks took their state from, as they told the recovery's verifying step ({} when not said)."""
        verifying = self.step("verifying") or {}
        return (verifying.get("data") or {}).get("resumed") or {}

    @property
    def restored_step(self) -> int | None:
        """The step the job went on from: a surviving peer's (peer recovery), or the checkpoint the recovery restored
        (0: none was validated, the job started over)."""
        if self.resumed.get("via") == "peer" and self.resumed.get("step") is not None:
            return int(self.resumed["step"])
        restoring = self.step("restoring")
        if restoring is None or restoring.get("ended_at") is None:
            return None
        checkpoint = (restoring.get("data") or {}).get("checkpoint")
        return int(checkpoint["step"]) if checkpoint else 0


@dataclass
class DemoRun:
    """Everything the scenario produced, for the summary, the timeline and the tests."""

    training: Training
    reference: Reference
    job: dict[str, Any]
    submitted_at: datetime
    running_at: datetime | None = None  # the job's ranks launched (on Slurm: once its allocation ran)
    faults: list[FaultRun] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # every recovery of the job, oldest first
    digest: str | None = None
    finished_at: datetime | None = None

    @property
    def params_equal(self) -> bool:
        """The job ended with the fault-free run's parameters, bit for bit."""
        return self.digest is not None and self.digest == self.reference.digest

    @property
    def unplanned(self) -> list[dict[str, Any]]:
        """Recoveries no injected fault accounts for."""
        claimed = {f.recovery["id"] for f in self.faults if f.recovery}
        return [r for r in self.recoveries if r["id"] not in claimed]

    @property
    def during_training(self) -> list[dict[str, Any]]:
        """Recoveries that began before training finished (a later one is about a job that is over)."""
        end = self.finished_at
        return [r for r in self.recoveries if end is None or datetime.fromisoformat(r["started_at"]) < end]

    @property
    def ok(self) -> bool:
        """Every recovery during training recovered and the parameters are the reference's."""
        return self.params_equal and all(r.get("outcome") == "recovered" for r in self.during_training)
