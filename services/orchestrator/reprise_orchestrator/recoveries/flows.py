"""The recovery flow: one claimed recovery driven to its end by whoever holds the job's lock and newest fence.

detected → locked → [stopping_ranks → isolating → placing → restoring → launching → verifying]+ → running (or failed,
or held for a human). The bracketed steps are one attempt (recoveries/steps.py). After each step the flow proposes
the next transition and the policy (recoveries/rules.py) answers; the service records a step only once the policy
accepted it. Every write and every command carries the fence, so an owner that paused past its lease changes nothing
once a newer owner exists.

A claimed recovery and an orphaned one (its owner died) take the same path, `run`: it rebuilds what the finished
steps decided from their typed records and goes on from the last one. Recoveries run side by side, each in a task of
the replica's runner (recoveries/runner.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import datetime
from functools import partial
from typing import Any, cast

from sqlmodel import Session

from reprise_common import subjects
from reprise_common.errors import BusError, ConflictError, RepriseError
from reprise_common.events import RecoveryChange, RecoveryChangeKind
from reprise_common.logging import get_logger
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.jobs import service as jobs
from reprise_orchestrator.jobs.launch import end_placement
from reprise_orchestrator.jobs.models import Job, JobState
from reprise_orchestrator.locks import LockHandle
from reprise_orchestrator.recoveries import facts, fences, rules, service
from reprise_orchestrator.recoveries.fences import FENCE_ATTEMPTS, Refused
from reprise_orchestrator.recoveries.lease import Lease
from reprise_orchestrator.recoveries.models import Recovery
from reprise_orchestrator.recoveries.records import (
    Isolated,
    Placed,
    StepData,
    StepRecord,
    Then,
    Verified,
    VerifyPath,
    baseline_of,
    incident_of,
)
from reprise_orchestrator.recoveries.rules import Decision, Proposal
from reprise_orchestrator.recoveries.run import RecoveryRun
from reprise_orchestrator.recoveries.service import Current, Ending, FencedOutError, TransitionRefusedError
from reprise_orchestrator.recoveries.states import ATTEMPT_STEPS, TERMINAL_STEPS, Outcome, RecoveryStep
from reprise_orchestrator.recoveries.steps import RecoverySteps, StepResult

log = get_logger("reprise.orchestrator.recovery")
Started = tuple[RecoveryRun, StepRecord]  # a run to drive, and the newest record of its recovery
# Steps after which news of the incident means isolating and placing again within the attempt; after the launch,
# news means a new attempt (the new epoch runs on a plan that did not know it).
REPLANNABLE = frozenset({RecoveryStep.ISOLATING, RecoveryStep.PLACING, RecoveryStep.RESTORING})
# What a recovery that verified its new epoch says, by how it verified it. Every rank exited 0: the job is over, and
# the reconciler's next pass marks it completed (jobs/flows.py `complete_finished`, the one place that decides it).
RECOVERED_DETAIL = {
    VerifyPath.STEPS: "training progressing again",
    VerifyPath.SETTLED: "every rank alive and working past the settle time (the job reports no steps)",
    VerifyPath.COMPLETED: "every rank exited 0: training finished while the recovery verified it",
}


class LockLostError(RepriseError):
    """The job's lock lease could not be renewed: another replica may own the job now."""


class RecoveryFlow:
    """Drives recoveries; `run` is the one way in, for a fresh claim and for an orphan alike."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self.steps = RecoverySteps(deps)
        self.lease = Lease(deps)
        self.runs: dict[str, RecoveryRun] = {}  # recovery id → its run, while this replica drives it

    def notify(self, recovery_id: str) -> None:
        """The recovery's incident learned something: wake the run if it waits (it reads the news itself)."""
        run = self.runs.get(recovery_id)
        if run is not None:
            run.news.set()

    async def run(self, handle: LockHandle, recovery_id: str, claimed: Started | None = None) -> None:
        """Own the recovery under `handle` (taking it over from a dead owner if needed) and drive it to its end.

        A fresh claim hands over what it just wrote (`claimed`); anything else is rebuilt from the records.
        """
        start = claimed or await self._take(handle, recovery_id)
        if start is None:
            return
        run, last = start
        self.runs[recovery_id] = run
        renewal = asyncio.create_task(self.lease.keep(run), name=f"renew:{recovery_id}")
        try:
            if run.step is RecoveryStep.LOCKED:
                await self._publish(run, RecoveryChangeKind.STARTED, RecoveryStep.LOCKED)
            elif last.done:
                log.info("resuming a recovery", extra={"recovery_id": recovery_id, "after": run.step.value})
            done = StepResult(cast("StepData", last.data), last.then, last.outcome) if last.done else None
            await self._drive(run, done)
        except (FencedOutError, LockLostError) as exc:
            log.warning("standing down: lost ownership of the job", extra={"job_id": run.job.id, "why": str(exc)})
        finally:
            self.runs.pop(recovery_id, None)
            renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewal

    async def _take(self, handle: LockHandle, recovery_id: str) -> Started | None:
        """Own an orphaned recovery under `handle`; when SQL refuses its fence (the lock store's counter was behind),
        under a fresh fence above the stored one, drawn with the same lock."""
        held, owned = await fences.claim_under_fresh_fences(
            self.deps, handle, lambda fenced: self._own(fenced, recovery_id), where="take_over"
        )
        # None: the lock is no longer ours, or every fence was refused; a later reconcile pass looks again
        return None if held is None or isinstance(owned, Refused) else owned

    def _own(self, handle: LockHandle, recovery_id: str) -> Started | Refused | None:
        """The run of a recovery this replica now owns, rebuilt from its records, and its newest record; Refused
        when SQL holds a fence at or above the handle's."""
        with Session(self.deps.engine) as session:
            recovery = session.get(Recovery, recovery_id)
            if recovery is None or recovery.step in TERMINAL_STEPS:
                return None
            # Claimed even when the fences are equal: a counter that started again (the store lost its data) can
            # hand out the fence the last owner holds.
            if not jobs.claim_fence(session, job_id=recovery.job_id, fence=handle.fence):
                return Refused(fence=handle.fence, stored=service.stored_fence(session, job_id=recovery.job_id))
            recovery = service.take_over(
                session, recovery_id=recovery_id, fence=handle.fence, owner=self.deps.settings.replica_id
            )
            job = jobs.get(session, job_id=recovery.job_id)
            records = service.records(session, recovery_id=recovery_id)
        run = RecoveryRun(
            handle,
            recovery.id,
            job,
            incident_of(records),
            baseline_of(records),
            attempt=recovery.attempt,
            step=recovery.step,
        )
        planned = max((r.data.symptoms for r in records if isinstance(r.data, Isolated)), default=0)
        if recovery.learned is not None and planned >= recovery.learned.symptom_count:
            run.incident = recovery.learned  # the plan so far already answers the incident's newest version
        for record in records:  # the placement of an earlier attempt too: its nodes may run ranks to stop
            if record.done and (record.attempt == run.attempt or isinstance(record.data, Placed)):
                run.adopt(record)
        isolations = sum(r.attempt == run.attempt and r.step is RecoveryStep.ISOLATING for r in records)
        run.replans = max(0, isolations - 1)  # the first isolation of an attempt is no re-plan
        return run, records[-1]

    async def _drive(self, run: RecoveryRun, result: StepResult | None) -> None:
        """Run the current step (unless it already ended with `result`), then move on as the policy says, until an
        end; each transition (the step's end, the next one's start) is one transaction."""
        while run.step not in TERMINAL_STEPS:
            ending = None
            if result is None:
                result = await self._act(run)
                ending = Ending(run.step, run.attempt, result.data, result.then, result.outcome)
            answer, proposal = self._transition(run, partial(self._next, run, result), ending)
            if answer.decision is Decision.WAIT:
                await asyncio.sleep(answer.delay_s)
                continue  # the same proposal again, with the time then
            if answer.decision is Decision.REJECT and proposal.learned:
                continue  # no re-plan: go on with the plan as it is (the run already took the news)
            if answer.decision is Decision.REJECT:
                refused = self._end(run, Outcome.TRANSITION_REFUSED, f"refused: {answer.detail} ({answer.rule})")
                answer, proposal = self._transition(run, refused)
            elif answer.decision is Decision.ABORT:
                aborted = self._end(run, answer.outcome or Outcome.TRANSITION_REFUSED, answer.detail)
                answer, proposal = self._transition(run, aborted)
            if answer.decision is not Decision.ACCEPT:
                raise TransitionRefusedError(f"the policy did not let recovery {run.recovery_id} end: {answer}")
            self._moved(run, proposal)
            await self._after_move(run, proposal)
            result = None

    def _next(self, run: RecoveryRun, result: StepResult | None, current: Current) -> Proposal:
        """The transition a step's result asks for, re-planning when the incident learned something meanwhile
        (`current`: the recovery as this transaction reads it, the news of its incident, when its step ended)."""
        now = self.deps.clock.now()
        assert result is not None  # the step ran, or had ended before this replica took the recovery over
        if result.then is Then.STOP:
            assert result.outcome is not None
            return self._end(run, result.outcome, result.detail)
        if result.then is Then.RETRY:
            news = isinstance(result.data, Verified) and bool(result.data.learned)  # not a failure: no backoff
            return self._new_attempt(run, result.detail, ended=None if news else current.ended_at)
        verified = _verify_path(result) if run.step is RecoveryStep.VERIFYING else None
        over = verified is VerifyPath.COMPLETED  # the job is over: no news makes a relaunch worth it
        learned = run.take_news(current.learned) if run.step in ATTEMPT_STEPS and not over else ""
        if learned and run.step in REPLANNABLE:
            return run.proposal(RecoveryStep.ISOLATING, now=now, learned=learned)
        if learned and run.step in (RecoveryStep.LAUNCHING, RecoveryStep.VERIFYING):
            return self._new_attempt(run, learned, ended=None)  # the new epoch runs on a plan that did not know it
        if verified is not None:
            return self._end(run, Outcome.RECOVERED, _recovered_detail(verified, result))
        order = (RecoveryStep.LOCKED, *ATTEMPT_STEPS)
        return run.proposal(order[order.index(run.step) + 1], now=now)

    def _new_attempt(self, run: RecoveryRun, detail: str, *, ended: datetime | None) -> Proposal:
        now = self.deps.clock.now()
        return run.proposal(
            RecoveryStep.STOPPING_RANKS, now=now, to_attempt=run.attempt + 1, detail=detail, attempt_ended_at=ended
        )

    def _end(self, run: RecoveryRun, outcome: Outcome, detail: str) -> Proposal:
        return run.proposal(rules.end_step(outcome), now=self.deps.clock.now(), outcome=outcome, detail=detail)

    def _transition(
        self, run: RecoveryRun, propose: Proposal | Callable[[Current], Proposal], ending: Ending | None = None
    ) -> tuple[rules.Answer, Proposal]:
        """Record the ending (if any) and make the proposed move, in one transaction; a callable proposes with the
        recovery as the transaction reads it."""
        known = propose
        with Session(self.deps.engine) as session:
            return service.transition(
                session,
                recovery_id=run.recovery_id,
                fence=run.handle.fence,
                at=self.deps.clock.now(),
                propose=known if callable(known) else lambda _: known,
                ending=ending,
            )

    def _moved(self, run: RecoveryRun, proposal: Proposal) -> None:
        """Update the run for the step it moved to (a new attempt plans again; a re-plan counts)."""
        if proposal.to_attempt != run.attempt:
            run.exclude, run.replans = set(), 0  # the new attempt's isolation finds its exclusions again
        elif proposal.learned:
            run.replans += 1
        run.step, run.attempt = proposal.to_step, proposal.to_attempt

    async def _act(self, run: RecoveryRun) -> StepResult:
        if run.lock_lost.is_set():
            raise LockLostError(f"lock on job {run.job.id} lost before {run.step.value}")
        return await self.steps.by_step[run.step](run)

    async def _after_move(self, run: RecoveryRun, moved: Proposal) -> None:
        if run.step not in TERMINAL_STEPS:
            await self._publish(run, RecoveryChangeKind.STEP, run.step, started=True)
            return
        outcome, detail = moved.outcome or Outcome.TRANSITION_REFUSED, moved.detail
        if run.step is not RecoveryStep.RUNNING:
            await self._wind_down(run)
        change = RecoveryChangeKind.SUCCEEDED if run.step is RecoveryStep.RUNNING else RecoveryChangeKind.FAILED
        await self._publish(run, change, run.step, detail, outcome=outcome)
        if run.restore is not None:
            await self.deps.registry.unpin(run.restore.checkpoint_id, holder=run.recovery_id)
        log.info(
            "recovery finished", extra={"recovery_id": run.recovery_id, "outcome": outcome.value, "detail": detail}
        )

    async def _wind_down(self, run: RecoveryRun) -> None:
        """A job that failed or waits for a human runs nothing: stop what is left (a hang's ranks' stacks first, when
        the recovery never stopped them: the person it waits for wants them most) and tell the detector."""
        node_ids = list(dict.fromkeys([*run.job.nodes(), *(r.node_id for r in run.ranks)]))
        operation = f"{run.recovery_id}:end"
        stacks_for = facts.stacks_wanted(run.incident, attempt=run.attempt)  # an agent captures once per incident
        await self.deps.compute.stop(
            run.job.id, node_ids, operation_id=operation, fence=run.handle.fence, stacks_for=stacks_for
        )
        await end_placement(self.deps, run.job, operation_id=f"{run.recovery_id}:inactive", fence=run.handle.fence)

    async def _publish(
        self,
        run: RecoveryRun,
        change: RecoveryChangeKind,
        step: RecoveryStep,
        detail: str = "",
        *,
        outcome: Outcome | None = None,
        started: bool = False,
    ) -> None:
        event = RecoveryChange(
            source="orchestrator",
            change=change,
            recovery_id=run.recovery_id,
            job_id=run.job.id,
            incident_id=run.incident.incident_id,
            step=step,
            fence=run.handle.fence,
            detail=detail,
            attempt=run.attempt,
            outcome=outcome,
            step_started_at=self.deps.clock.now() if started else None,
            labels=run.job.labels,
        )
        replan = f":{run.replans}" if run.replans else ""
        try:
            await self.deps.bus.publish(
                subjects.recovery(run.job.id, change),
                event,
                msg_id=f"{run.recovery_id}:{run.attempt}:{change}:{step.value}{replan}",
            )
        except BusError as exc:  # the recovery itself matters more than its announcement
            log.warning("could not publish a recovery change", extra={"error": str(exc)})


def _recovered_detail(verified: VerifyPath, result: StepResult) -> str:
    """What the recovered alert says: how training was seen again, and where the ranks' state came from."""
    detail = RECOVERED_DETAIL[verified]
    resumed = result.data.resumed if isinstance(result.data, Verified) else None
    if resumed is None:
        return detail
    if resumed.via == "peer" and resumed.step is not None:
        return f"{detail}: resumed at step {resumed.step} from the surviving ranks' state, 0 steps redone"
    return f"{detail} from the checkpoint ({resumed.why})" if resumed.why else f"{detail} from the checkpoint"


def _verify_path(result: StepResult) -> VerifyPath:
    """How a passed verifying step verified (a record from before paths were recorded: by steps)."""
    data = result.data
    return data.path if isinstance(data, Verified) and data.path is not None else VerifyPath.STEPS


async def cancel(deps: Deps, job_id: str) -> Job:
    """Cancel a job: a fresh fence (no lock needed) fences out any running recovery, which ends as cancelled; then
    the job's ranks are stopped. A fence SQL refuses is drawn again above the stored one (the counter may be behind
    it after the lock store lost its data, or another owner drew one meanwhile)."""
    with Session(deps.engine) as session:
        job = jobs.get(session, job_id=job_id)
        if job.state in (JobState.CANCELLED, JobState.FAILED, JobState.COMPLETED):
            return job
    fence = await deps.locks.next_fence(job_id)
    refused = _cancel_fenced(deps, job_id, fence)
    for _ in range(FENCE_ATTEMPTS - 1):
        if refused is None:
            break
        await deps.locks.floor_fence(job_id, refused.stored)
        fence = await deps.locks.next_fence(job_id)
        refused = _cancel_fenced(deps, job_id, fence)
    if refused is not None:
        raise ConflictError(f"job {job_id}: a newer fencing token owns it; try again")
    with Session(deps.engine) as session:
        job = jobs.get(session, job_id=job_id)
    operation = f"{job_id}:cancel:{fence}"
    await deps.compute.stop(job_id, job.nodes(), operation_id=operation, fence=fence)
    await end_placement(deps, job, operation_id=operation, fence=fence)
    log.info("job cancelled", extra={"job_id": job_id, "fence": fence})
    return job


def _cancel_fenced(deps: Deps, job_id: str, fence: int) -> Refused | None:
    """Claim the job for the cancel and mark it cancelled in the same statement (a claim that reads the job
    meanwhile never sees it active under the cancel's fence), and end its running recovery; Refused when SQL holds
    a fence at or above this one."""
    with Session(deps.engine) as session:
        cancelled: dict[str, Any] = {"state": JobState.CANCELLED, "detail": "cancelled"}
        if not jobs.claim_fence(session, job_id=job_id, fence=fence, commit=False, **cancelled):
            session.rollback()
            return Refused(fence=fence, stored=service.stored_fence(session, job_id=job_id))
        active = service.find_active(session, job_id=job_id)
        if active is not None:
            _end_cancelled(session, deps, active, fence)  # its end state is written over below
        jobs.update_fenced(session, job_id=job_id, fence=fence, **cancelled)
    return None


def _end_cancelled(session: Session, deps: Deps, recovery: Recovery, fence: int) -> None:
    job = jobs.get(session, job_id=recovery.job_id)
    steps = service.records(session, recovery_id=recovery.id)
    proposal = Proposal(
        from_step=recovery.step,
        from_attempt=recovery.attempt,
        to_step=rules.end_step(Outcome.CANCELLED),
        to_attempt=recovery.attempt,
        job=job,
        incident=incident_of(steps),
        policy=job.job_spec().policy,
        now=deps.clock.now(),
        baseline=baseline_of(steps),
        outcome=Outcome.CANCELLED,
        detail="the job was cancelled",
    )
    service.move(session, recovery_id=recovery.id, fence=fence, proposal=proposal, at=deps.clock.now())
