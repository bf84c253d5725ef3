"""One recovery while it runs (RecoveryRun): who owns it, the incident its plan answers, what its finished steps
decided, and the transitions it proposes to the policy from where it is."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any

from reprise_common.events import IncidentChange, RankAssignment
from reprise_orchestrator.jobs.models import Job, RecoveryPolicy
from reprise_orchestrator.locks import LockHandle
from reprise_orchestrator.recoveries import facts
from reprise_orchestrator.recoveries.records import Baseline, Isolated, Placed, Restored, StepRecord, Stopped
from reprise_orchestrator.recoveries.rules import Proposal
from reprise_orchestrator.recoveries.states import RecoveryStep
from reprise_orchestrator.registry_client import RestorePoint


@dataclass
class RecoveryRun:
    """One recovery while it runs: who owns it, what the plan answers, and what its finished steps decided."""

    handle: LockHandle
    recovery_id: str
    job: Job
    incident: IncidentChange  # the version of the incident the current plan answers
    baseline: Baseline
    attempt: int = 1
    lock_lost: asyncio.Event = field(default_factory=asyncio.Event)
    news: asyncio.Event = field(default_factory=asyncio.Event)  # set when this replica learned of an update
    exclude: set[str] = field(default_factory=set)
    ranks: list[RankAssignment] = field(default_factory=list)
    restore: RestorePoint | None = None
    step: RecoveryStep = RecoveryStep.LOCKED  # the step it is at
    replans: int = 0  # re-plans made in this attempt

    @property
    def operation(self) -> str:
        """The command-id prefix of this attempt: a retry sends new commands, a resume repeats the same ones."""
        return f"{self.recovery_id}:{self.attempt}"

    def adopt(self, record: StepRecord) -> None:
        """Take over what a finished step decided (used when a recovery is resumed, by this or another replica)."""
        data = record.data
        if isinstance(data, Stopped) and not facts.scheduler_took_the_nodes(self.incident):
            self.exclude |= set(data.agents_gone)
        elif isinstance(data, Isolated):
            self.exclude |= set(data.excluded)
        elif isinstance(data, Placed) and data.ranks:
            self.ranks = list(data.ranks)
        elif isinstance(data, Restored) and data.checkpoint is not None:
            c = data.checkpoint
            self.restore = RestorePoint(c.id, c.step, c.path, digests_checked=data.digests_checked)

    def take_news(self, latest: IncidentChange | None) -> str:
        """What `latest` (the newest version of the incident) knows that the plan did not ("" when nothing); the run
        plans with it from now on."""
        what = facts.learned(self.incident, latest) if latest is not None else ""
        if what and latest is not None:
            self.incident = latest
        return what

    @cached_property
    def policy(self) -> RecoveryPolicy:
        """The job's recovery policy (its spec does not change while the job lives)."""
        return self.job.job_spec().policy

    def proposal(
        self, to_step: RecoveryStep, *, now: datetime, to_attempt: int | None = None, **given: Any
    ) -> Proposal:
        """A transition from where the run is, with the facts the rules need."""
        return Proposal(
            from_step=self.step,
            from_attempt=self.attempt,
            to_step=to_step,
            to_attempt=self.attempt if to_attempt is None else to_attempt,
            job=self.job,
            incident=self.incident,
            policy=self.policy,
            now=now,
            baseline=self.baseline,
            replans=self.replans,
            **given,
        )
