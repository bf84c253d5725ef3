"""Running a drill: inject the fault through the node's agent, then watch the recovery that follows."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

from sqlmodel import Session

from reprise_common import subjects
from reprise_common.errors import BusError, ConflictError
from reprise_common.events import FaultKind, InjectFault, InjectReply, new_id
from reprise_common.logging import get_logger
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.drills import service
from reprise_orchestrator.drills.models import Drill, DrillCreate, DrillFault, DrillState
from reprise_orchestrator.jobs import service as jobs
from reprise_orchestrator.jobs.models import JobState
from reprise_orchestrator.recoveries import service as recoveries
from reprise_orchestrator.recoveries.models import Recovery
from reprise_orchestrator.recoveries.records import StepRecord
from reprise_orchestrator.recoveries.states import Outcome, RecoveryStep

log = get_logger("reprise.orchestrator.drills")
POLL_S = 0.25
KINDS = {
    DrillFault.KILL_RANK: FaultKind.RANK_KILL,
    DrillFault.XID79: FaultKind.XID,
    DrillFault.HANG: FaultKind.RANK_HANG,
    DrillFault.NODE_LOSS: FaultKind.NODE_LOSS,
}


class DrillRunner:
    """Starts drills and keeps their watchers alive until they finish."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, job_id: str, body: DrillCreate) -> Drill:
        """Inject the fault now (409 if the job is not running or the node refuses); watch the recovery after."""
        with Session(self.deps.engine) as session:
            job = jobs.get(session, job_id=job_id)
            if job.state is not JobState.RUNNING:
                raise ConflictError(f"job {job_id} is {job.state.value}: drills need a running job")
            ranks = list(job.placement)
            objective = job.job_spec().policy.recovery_time_objective_s
            earlier = {r.id for r in recoveries.get_all_by_job(session, job_id=job_id)}  # not this drill's
        target = next((r for r in ranks if r.rank == body.rank), None) if body.rank is not None else ranks[-1]
        if target is None:
            raise ConflictError(f"job {job_id} has no rank {body.rank}")
        fault = InjectFault(
            kind=KINDS[body.fault],
            gpu=target.gpu or 0,
            xid=79 if body.fault is DrillFault.XID79 else None,
            rank=target.rank,
            job_id=job_id,
        )
        injected_at = self.deps.clock.now()
        try:
            reply = await self.deps.bus.request(subjects.node_inject(target.node_id), fault, InjectReply, timeout=5.0)
        except BusError as exc:
            raise ConflictError(f"node {target.node_id} did not take the fault: {exc}") from exc
        if not reply.accepted:
            raise ConflictError(f"node {target.node_id} refused the fault: {reply.detail}")
        drill = Drill(
            id=f"drill-{new_id()[:12]}",
            job_id=job_id,
            fault=body.fault,
            rank=target.rank,
            node_id=target.node_id,
            objective_s=objective,
            injected_at=injected_at,
            detail=reply.detail,
        )
        with Session(self.deps.engine) as session:
            drill = service.create(session, drill=drill)
        watch = self._watch(drill.id, job_id, injected_at, objective, earlier=earlier)
        task = asyncio.create_task(watch, name=f"drill:{drill.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return drill

    async def _watch(
        self, drill_id: str, job_id: str, injected_at: datetime, objective_s: float, *, earlier: set[str]
    ) -> None:
        """Wait for the recovery the fault caused (one the job did not have before it) and record its timings."""
        deadline = self.deps.clock.monotonic() + max(3 * objective_s, 60.0)
        recovery: Recovery | None = None
        records: list[StepRecord] = []
        while self.deps.clock.monotonic() < deadline:
            with Session(self.deps.engine) as session:
                found = recoveries.get_all_by_job(session, job_id=job_id)
                steps = recoveries.records_of(session, recovery_ids=[r.id for r in found])
                fresh = [r for r in found if r.id not in earlier]
                recovery = next((r for r in fresh if _after(r, steps.get(r.id, []), injected_at)), None)
                records = steps.get(recovery.id, []) if recovery is not None else []
            if recovery is not None and recovery.finished_at is not None:
                break
            await asyncio.sleep(POLL_S)
        with Session(self.deps.engine) as session:
            service.update(
                session,
                drill_id=drill_id,
                finished_at=self.deps.clock.now(),
                **_measure(recovery, records, injected_at, objective_s),
            )
        log.info("drill finished", extra={"drill_id": drill_id, "job_id": job_id})

    async def stop(self) -> None:
        """Stop watching (drills still running stay so in the record)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _after(recovery: Recovery, records: list[StepRecord], injected_at: datetime) -> bool:
    """A recovery detected after the injection (the first symptom may be stamped on another host: 1 s of slack; a
    recovery the job had before the drill never counts, however recent)."""
    detected = records[0].started_at if records else recovery.started_at
    return detected >= injected_at - timedelta(seconds=1)


def _measure(
    recovery: Recovery | None, records: list[StepRecord], injected_at: datetime, objective_s: float
) -> dict[str, object]:
    if recovery is None or recovery.finished_at is None:
        return {
            "state": DrillState.FAILED,
            "detail": "no recovery finished in time",
            "recovery_id": recovery and recovery.id,
        }
    detected = (records[0].ended_at or records[0].started_at) if records else recovery.started_at
    verified = [s.ended_at for s in records if s.step is RecoveryStep.VERIFYING and s.ended_at is not None]
    done = verified[-1] if verified else recovery.finished_at
    values: dict[str, object] = {
        "recovery_id": recovery.id,
        "detection_s": round((detected - injected_at).total_seconds(), 3),
        "recovery_s": round((done - injected_at).total_seconds(), 3),
    }
    if recovery.outcome is not Outcome.RECOVERED:
        return values | {"state": DrillState.FAILED, "detail": f"recovery ended {recovery.outcome}: {recovery.detail}"}
    met = float(values["recovery_s"]) <= objective_s  # type: ignore[arg-type]
    verdict = "within" if met else "over"
    detail = f"recovered in {values['recovery_s']} s, {verdict} the {objective_s:g} s objective"
    return values | {"state": DrillState.PASSED if met else DrillState.MISSED, "detail": detail}
