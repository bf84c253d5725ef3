"""The recovery's steps, one method each, and the table that orders them.

Every step is safe to run again: commands carry ids derived from (recovery, attempt, action, node), cordons and
pins are idempotent, and what a step decided (the placement, the restore point, the rendezvous) is persisted with
its end, so a replica that resumes a recovery re-uses it instead of deciding again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import Any

from sqlmodel import Session

from reprise_common.errors import BusError
from reprise_common.events import CommandAction, IncidentChange, RankAssignment
from reprise_common.logging import get_logger
from reprise_orchestrator.agents import answers_record, command_nodes
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.jobs import service as jobs
from reprise_orchestrator.jobs.launch import launch, rendezvous_for
from reprise_orchestrator.jobs.models import Job
from reprise_orchestrator.jobs.placement import PlacementDecision, assign_ranks, replan
from reprise_orchestrator.locks import LockHandle
from reprise_orchestrator.nodes import service as nodes
from reprise_orchestrator.recoveries import policy
from reprise_orchestrator.recoveries.models import Outcome, RecoveryStep
from reprise_orchestrator.recoveries.service import FencedOutError
from reprise_orchestrator.registry_client import RegistryUnavailableError, RestorePoint

log = get_logger("reprise.orchestrator.recovery")
PIN_TTL_S = 3600.0  # a pin outlives any sane recovery, and expires if its owner dies holding it
POLL_S = 0.25


class Then(StrEnum):
    """What the recovery does after a step."""

    NEXT = "next"  # go on with the next step
    RETRY = "retry"  # a new attempt from stopping_ranks, after a backoff
    STOP = "stop"  # the recovery ends with the result's outcome (the job fails, or is held for a human)


@dataclass(frozen=True)
class StepResult:
    """A step's data for the record, and what follows it."""

    data: dict[str, Any]
    then: Then = Then.NEXT
    outcome: Outcome | None = None
    detail: str = ""


@dataclass
class RecoveryRun:
    """One recovery while it runs: who owns it, and what its finished steps decided."""

    handle: LockHandle
    recovery_id: str
    job: Job
    incident: IncidentChange
    attempt: int = 1
    lock_lost: asyncio.Event = field(default_factory=asyncio.Event)
    exclude: set[str] = field(default_factory=set)
    ranks: list[RankAssignment] = field(default_factory=list)
    restore: RestorePoint | None = None
    failed_loads: set[int] = field(default_factory=set)
    baseline: dict[str, Any] = field(default_factory=dict)  # the job's progress counters when the recovery began
    admission: policy.Verdict = policy.GO  # what the policy said before the first step

    @property
    def operation(self) -> str:
        """The command-id prefix of this attempt: a retry sends new commands, a resume repeats the same ones."""
        return f"{self.recovery_id}:{self.attempt}"

    def adopt(self, step: RecoveryStep, data: dict[str, Any]) -> None:
        """Take over what a finished step decided (used when a recovery is resumed by another replica)."""
        if step is RecoveryStep.STOPPING_RANKS:
            self.exclude |= set(data.get("agents_gone", []))
        elif step is RecoveryStep.ISOLATING:
            self.exclude |= set(data.get("excluded", []))
        elif step is RecoveryStep.PLACING and "ranks" in data:
            self.ranks = [RankAssignment.model_validate(r) for r in data["ranks"]]
        elif step is RecoveryStep.RESTORING and data.get("checkpoint"):
            c = data["checkpoint"]
            self.restore = RestorePoint(checkpoint_id=int(c["id"]), step=int(c["step"]), path=str(c["path"]))


class RecoverySteps:
    """The step actions; each returns a StepResult and raises FencedOutError when it learns it lost the job."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps

    def plan(self) -> list[tuple[RecoveryStep, Any]]:
        """The steps of one attempt, in order."""
        return [
            (RecoveryStep.STOPPING_RANKS, self.stop_ranks),
            (RecoveryStep.ISOLATING, self.isolate),
            (RecoveryStep.PLACING, self.place),
            (RecoveryStep.RESTORING, self.restore),
            (RecoveryStep.LAUNCHING, self.launch),
            (RecoveryStep.VERIFYING, self.verify),
        ]

    async def stop_ranks(self, run: RecoveryRun) -> StepResult:
        """A fenced stop to every node the job ran on (or was just launched on); silence counts as stopped."""
        nodes_ = list(dict.fromkeys([r["node_id"] for r in run.job.placement] + [r.node_id for r in run.ranks]))
        answers = await stop_nodes(self.deps, run.operation, run.job.id, run.handle.fence, nodes_)
        if any(a.stale for a in answers):
            raise FencedOutError("an agent refused our fence as stale")
        gone = sorted(a.node_id for a in answers if a.gone)
        run.exclude |= set(gone)  # no agent listens there: do not wait for the detector to call the node lost
        return StepResult({"answers": answers_record(answers), "agents_gone": gone})

    async def isolate(self, run: RecoveryRun) -> StepResult:
        """Cordon the culprit node of a hardware fault (within the circuit breaker); leave a lost node out."""
        incident, culprit = run.incident, run.incident.culprit.node_id
        if culprit is None or not policy.should_exclude(incident):
            return StepResult({"excluded": sorted(run.exclude), "cordoned": None})
        run.exclude |= {culprit}
        if not policy.should_cordon(incident):
            note = "lost node left out, not cordoned"
            return StepResult({"excluded": sorted(run.exclude), "cordoned": None, "note": note})
        spec = run.job.job_spec().policy
        now = self.deps.clock.now()
        with Session(self.deps.engine) as session:
            if culprit not in nodes.cordoned_ids(session):
                since = now - timedelta(seconds=spec.cordon_window_s)
                verdict = policy.cordon_allowed(
                    recent=nodes.count_recovery_cordons(session, since=since),
                    known_nodes=self.deps.inventory.known(),
                    share=spec.max_cordon_share,
                )
                if not verdict.proceed:
                    return StepResult({"excluded": sorted(run.exclude)}, Then.STOP, verdict.outcome, verdict.detail)
                nodes.cordon(
                    session,
                    node_id=culprit,
                    reason=incident.root_cause,
                    by=f"{nodes.RECOVERY_PREFIX}{run.recovery_id}",
                    job_id=run.job.id,
                    now=now,
                )
        return StepResult({"excluded": sorted(run.exclude), "cordoned": culprit})

    async def place(self, run: RecoveryRun) -> StepResult:
        """Spares in place of unusable nodes, else shrink within the elastic minimum, else wait for capacity."""
        spec = run.job.job_spec()
        current = list(dict.fromkeys(r["node_id"] for r in run.job.placement))
        deadline = self.deps.clock.monotonic() + spec.policy.placement_timeout_s
        while True:
            with Session(self.deps.engine) as session:
                unavailable = nodes.cordoned_ids(session) | jobs.busy_nodes(session, except_job=run.job.id)
            unavailable |= run.exclude
            inventory = self.deps.inventory
            spares = inventory.placeable(spares=True, exclude=unavailable)
            usable = set(inventory.placeable(exclude=unavailable)) | set(spares)
            plan = replan(current, usable=usable, spares=spares, policy=spec.policy)
            if plan.decision is not PlacementDecision.WAIT:
                break
            if self.deps.clock.monotonic() > deadline:
                detail = f"no capacity for {len(plan.dropped)} node(s) within {spec.policy.placement_timeout_s:g} s"
                return StepResult({"decision": plan.decision.value}, Then.STOP, Outcome.NO_CAPACITY, detail)
            await asyncio.sleep(POLL_S * 4)
        run.ranks = assign_ranks(plan.nodes, ranks_per_node=spec.ranks_per_node, inventory=self.deps.inventory)
        return StepResult(
            {
                "decision": plan.decision.value,
                "nodes": plan.nodes,
                "replaced": plan.replaced,
                "dropped": plan.dropped,
                "world_size": len(run.ranks),
                "ranks": [r.model_dump(mode="json") for r in run.ranks],
            }
        )

    async def restore(self, run: RecoveryRun) -> StepResult:
        """The newest validated checkpoint (the registry skips any that failed to load), pinned for the recovery."""
        for attempt in range(6):
            try:
                run.restore = await self.deps.registry.latest_validated(run.job.id)
                break
            except RegistryUnavailableError as exc:
                if attempt == 5:
                    return StepResult({}, Then.STOP, Outcome.REGISTRY_UNAVAILABLE, str(exc))
                await asyncio.sleep(0.5 * 2**attempt)
        self._count_progress(run)
        if run.restore is None:
            return StepResult({"checkpoint": None, "note": "no validated checkpoint: the job restarts from its start"})
        pinned = await self.deps.registry.pin(run.restore.checkpoint_id, holder=run.recovery_id, ttl_s=PIN_TTL_S)
        checkpoint = {"id": run.restore.checkpoint_id, "step": run.restore.step, "path": run.restore.path}
        return StepResult({"checkpoint": checkpoint, "pinned": pinned})

    def _count_progress(self, run: RecoveryRun) -> None:
        """Record on the job whether this recovery restores a newer checkpoint than the one before (idempotent)."""
        before = run.baseline.get("last_restore_step")
        step = run.restore.step if run.restore else None
        progress = (step if step is not None else -1) > (before if before is not None else -1)
        values: dict[str, Any] = {"last_restore_step": step if step is not None else before}
        values["no_progress_streak"] = 0 if progress else int(run.baseline.get("no_progress_streak", 0)) + 1
        if progress:
            values["same_error_streak"] = 1
        with Session(self.deps.engine) as session:
            if not jobs.update_fenced(session, job_id=run.job.id, fence=run.handle.fence, **values):
                raise FencedOutError("job taken over while restoring")

    async def launch(self, run: RecoveryRun) -> StepResult:
        """Publish the placement and a fenced launch with a new restart epoch and master port to every node."""
        epoch = run.job.restart_epoch + 1
        rendezvous = rendezvous_for(
            run.ranks,
            job_id=run.job.id,
            epoch=epoch,
            inventory=self.deps.inventory,
            port_base=self.deps.settings.master_port_base,
            engine=self.deps.engine,
        )
        try:
            answers = await launch(
                self.deps.bus,
                operation_id=run.operation,
                job_id=run.job.id,
                fence=run.handle.fence,
                spec=run.job.job_spec(),
                ranks=run.ranks,
                rendezvous=rendezvous,
                restore=run.restore,
                timeout_s=self.deps.settings.command_timeout_s,
            )
        except BusError as exc:  # the placement could not be published, so nothing was launched: try again
            return StepResult({"restart_epoch": epoch, "error": str(exc)}, Then.RETRY, detail=str(exc))
        if any(a.stale for a in answers):
            raise FencedOutError("an agent refused our fence as stale")
        data = {
            "restart_epoch": epoch,
            "master_port": rendezvous.master_port,
            "answers": answers_record(answers),
        }
        if not all(a.ok for a in answers):
            return StepResult(data, Then.RETRY, detail="launch not confirmed by every node")
        with Session(self.deps.engine) as session:
            if not jobs.update_fenced(
                session,
                job_id=run.job.id,
                fence=run.handle.fence,
                restart_epoch=epoch,
                master_port=rendezvous.master_port,
                placement=[r.model_dump(mode="json") for r in run.ranks],
                restarts=run.job.restarts + 1,
                restart_times=[*run.job.restart_times, self.deps.clock.now().isoformat()],
            ):
                raise FencedOutError("job taken over during launch")
            run.job = jobs.get(session, job_id=run.job.id)
        return StepResult(data)

    async def verify(self, run: RecoveryRun) -> StepResult:
        """Wait until every rank of the new epoch reports a step at or past the restored checkpoint's."""
        target = run.restore.step if run.restore else 0
        epoch = run.job.restart_epoch
        timeout = run.job.job_spec().policy.verify_timeout_s
        deadline = self.deps.clock.monotonic() + timeout
        wanted = {r.rank for r in run.ranks}
        while True:
            seen = self.deps.inventory.ranks_of(run.job.id, restart_epoch=epoch)
            dead = sorted(r for r in wanted if r in seen and not seen[r].alive)
            if dead:
                return await self._verify_failed(run, dead, seen, target)
            ready = [r for r in wanted if r in seen and seen[r].step is not None and (seen[r].step or 0) >= target]
            if len(ready) == len(wanted):
                return StepResult({"target_step": target, "steps": {str(r): seen[r].step for r in sorted(wanted)}})
            if self.deps.clock.monotonic() > deadline:
                missing = sorted(wanted - set(ready))
                detail = f"ranks {missing} did not pass step {target} within {timeout:g} s"
                return StepResult({"target_step": target, "missing": missing}, Then.RETRY, detail=detail)
            await asyncio.sleep(POLL_S)

    async def _verify_failed(self, run: RecoveryRun, dead: list[int], seen: dict[int, Any], target: int) -> StepResult:
        data: dict[str, Any] = {"target_step": target, "dead_ranks": dead}
        never_stepped = all(seen[r].step is None for r in dead)
        if run.restore is not None and never_stepped:  # died before training one step: loading failed
            reason = f"ranks {dead} exited before their first step after restoring it (recovery {run.recovery_id})"
            data["load_failed"] = await self.deps.registry.load_failed(run.restore.checkpoint_id, reason=reason)
            run.failed_loads.add(run.restore.checkpoint_id)
        return StepResult(data, Then.RETRY, detail=f"ranks {dead} exited while the recovery was verified")


async def stop_nodes(deps: Deps, operation: str, job_id: str, fence: int, node_ids: list[str]) -> list[Any]:
    """A fenced stop (with the grace period) to each node; every answer, or its absence, is returned."""
    grace = deps.settings.stop_grace_s
    return await command_nodes(
        deps.bus,
        operation_id=operation,
        job_id=job_id,
        fence=fence,
        action=CommandAction.STOP,
        args_by_node={node: {"grace_s": grace} for node in node_ids},
        timeout_s=deps.settings.command_timeout_s + grace,
    )
