"""The actions of one recovery attempt: stop, isolate, place, restore, launch, verify.

Each action works on the recovery's RecoveryRun (recoveries/run.py: what the finished steps decided) and returns a
StepResult: its typed data for the record and what should follow. Actions raise FencedOutError when they learn the
job has a newer owner. Whether what follows may happen is for the policy to say (recoveries/rules.py), not for the
actions.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from sqlmodel import Session

from reprise_common.errors import BusError
from reprise_common.logging import get_logger
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.jobs import checkpoints
from reprise_orchestrator.jobs import service as jobs
from reprise_orchestrator.jobs.launch import Rendezvous, launch, rendezvous_for
from reprise_orchestrator.jobs.placement import (
    PlacementDecision,
    assign_ranks,
    container_fit,
    replacements,
    replan,
)
from reprise_orchestrator.nodes import flows as node_flows
from reprise_orchestrator.nodes import service as nodes
from reprise_orchestrator.recoveries import facts, restart, rules, service
from reprise_orchestrator.recoveries import verify as verifying
from reprise_orchestrator.recoveries.records import (
    CheckpointRef,
    Isolated,
    Launched,
    Placed,
    Restored,
    StepData,
    Stopped,
    Then,
    Verified,
)
from reprise_orchestrator.recoveries.rules import CordonFacts, Decision
from reprise_orchestrator.recoveries.run import RecoveryRun
from reprise_orchestrator.recoveries.service import FencedOutError
from reprise_orchestrator.recoveries.states import Outcome, RecoveryStep
from reprise_orchestrator.registry_client import RegistryUnavailableError

T = TypeVar("T")
log = get_logger("reprise.orchestrator.recovery")
PIN_TTL_S = 3600.0  # a pin outlives any sane recovery, and expires if its owner dies holding it
POLL_S = 0.25
RESTART_TIMES_KEPT = 1000  # the restart budget never counts more (RecoveryPolicy.max_restarts <= 1000)


@dataclass(frozen=True)
class StepResult:
    """A step's data for the record, and what follows it."""

    data: StepData
    then: Then = Then.NEXT
    outcome: Outcome | None = None
    detail: str = ""


class RecoverySteps:
    """The step actions, looked up by step."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self.by_step = {
            RecoveryStep.STOPPING_RANKS: self.stop_ranks,
            RecoveryStep.ISOLATING: self.isolate,
            RecoveryStep.PLACING: self.place,
            RecoveryStep.RESTORING: self.restore,
            RecoveryStep.LAUNCHING: self.launch,
            RecoveryStep.VERIFYING: self.verify,
        }

    def news(self, run: RecoveryRun) -> str:
        """What the incident learned since the plan was made ("" when nothing), read from the recovery's record."""
        with Session(self.deps.engine) as session:
            return run.take_news(service.learned_incident(session, recovery_id=run.recovery_id))

    async def stop_ranks(self, run: RecoveryRun) -> StepResult:
        """A fenced stop to every node the job ran on (or was just launched on); silence counts as stopped. Ranks
        that can restart in place are parked instead, when the policy and the attempt allow (recoveries/restart.py)."""
        gone = facts.node_gone(run.incident)
        if gone is not None:  # its last report may look fresh a while yet: no placement, and no spare's standbys, there
            self.deps.inventory.agent_gone(gone)
        node_ids = [n for n in dict.fromkeys([*run.job.nodes(), *(r.node_id for r in run.ranks)]) if n != gone]
        stacks_for = facts.stacks_wanted(run.incident, attempt=run.attempt)
        chosen = restart.plan(run.incident, run.policy, attempt=run.attempt)
        answers = await self.deps.compute.stop(
            run.job.id,
            node_ids,
            operation_id=run.operation,
            fence=run.handle.fence,
            stacks_for=stacks_for,
            in_place=chosen.in_place,
        )
        if answers.stale:
            raise FencedOutError("a node refused our fence as stale")
        silent = answers.gone()
        if not facts.scheduler_took_the_nodes(run.incident):
            run.exclude |= set(silent)  # no agent listens there: do not wait for the detector to call the node lost
        mode, parked, why = restart.outcome(chosen, answers)
        stopped = Stopped(
            answers=answers.record(),
            agents_gone=silent,
            not_asked=[] if gone is None else [gone],
            stacks_for=stacks_for,
            restart_mode=mode,
            parked=len(parked),
            why=why,
        )
        return StepResult(stopped)

    async def isolate(self, run: RecoveryRun) -> StepResult:
        """Cordon the culprit node of a hardware fault (if the circuit breaker allows); leave a lost node out."""
        incident, culprit = run.incident, run.incident.culprit.node_id

        def isolated(**fields: Any) -> Isolated:
            return Isolated(excluded=sorted(run.exclude), culprit=culprit, symptoms=incident.symptom_count, **fields)

        if culprit is None or not facts.should_exclude(incident):
            return StepResult(isolated())
        run.exclude |= {culprit}
        if not facts.should_cordon(incident):
            return StepResult(isolated(note="lost node left out, not cordoned"))
        by = f"{nodes.RECOVERY_PREFIX}{run.recovery_id}"
        now = self.deps.clock.now()
        window = timedelta(seconds=run.job.job_spec().policy.cordon_window_s)
        with Session(self.deps.engine) as session:
            already = culprit in nodes.cordoned_ids(session)
            recent = nodes.count_recovery_cordons(session, since=now - window, other_than=by)
            started_by = service.incident_of(session, recovery_id=run.recovery_id)  # named in the backend's cordon
        if not already:
            cordon = CordonFacts(node_id=culprit, recent=recent, known_nodes=self.deps.compute.known_nodes())
            leaving = run.proposal(RecoveryStep.PLACING, now=now, cordon=cordon)
            answer = rules.decide(leaving, recovery_id=run.recovery_id)
            if answer.decision is Decision.ABORT:
                return StepResult(isolated(), Then.STOP, answer.outcome, answer.detail)
            await node_flows.cordon(
                self.deps, node_id=culprit, reason=incident.root_cause, by=by, job_id=run.job.id, incident_id=started_by
            )
        return StepResult(isolated(cordoned=culprit))

    async def place(self, run: RecoveryRun) -> StepResult:
        """Spares in place of unusable nodes, else shrink within the elastic minimum, else wait for capacity."""
        spec = run.job.job_spec()
        current = run.job.nodes()
        deadline = self.deps.clock.monotonic() + spec.policy.placement_timeout_s
        while True:
            with Session(self.deps.engine) as session:
                unavailable = nodes.cordoned_ids(session) | jobs.busy_nodes(session, except_job=run.job.id)
            offered = self.deps.compute.pool(exclude=unavailable | run.exclude, job_id=run.job.id)
            pool = container_fit(spec, offered, self.deps.inventory)  # nodes that run its container, if it has one
            plan = replan(current, usable=pool.usable(), spares=replacements(pool, current), policy=spec.policy)
            if plan.decision is not PlacementDecision.WAIT:
                break
            if self.deps.clock.monotonic() > deadline:
                detail = f"no capacity for {len(plan.dropped)} node(s) within {spec.policy.placement_timeout_s:g} s"
                return StepResult(Placed(decision=plan.decision), Then.STOP, Outcome.NO_CAPACITY, detail)
            await asyncio.sleep(POLL_S * 4)
        run.ranks = assign_ranks(plan.nodes, ranks_per_node=spec.ranks_per_node, inventory=self.deps.inventory)
        with Session(self.deps.engine) as session:  # other placements keep off these nodes until the launch
            if not jobs.update_fenced(session, job_id=run.job.id, fence=run.handle.fence, reserved_nodes=plan.nodes):
                raise FencedOutError("job taken over while placing")
        return StepResult(
            Placed(
                decision=plan.decision,
                nodes=plan.nodes,
                replaced=plan.replaced,
                dropped=plan.dropped,
                world_size=len(run.ranks),
                ranks=run.ranks,
            )
        )

    async def restore(self, run: RecoveryRun) -> StepResult:
        """The newest validated checkpoint that passes the registry's re-check now (it skips any that failed to load
        and marks corrupt any whose files vanished or changed size), pinned for the recovery; after a numeric fault,
        the newest one before the fault's step."""
        before = facts.restore_before(run.incident)
        try:
            pick = await self._registry(lambda: self.deps.registry.restore_point(run.job.id, before_step=before))
        except RegistryUnavailableError as exc:
            return StepResult(Restored(), Then.STOP, Outcome.REGISTRY_UNAVAILABLE, str(exc))
        run.restore, skipped = pick.point, pick.skipped
        self._count_progress(run)
        rollback = f"a numeric fault at step {before}: rolled back to a checkpoint before it" if before else ""
        if run.restore is None:
            note = "no validated checkpoint" + (f" before step {before}" if before else "")
            start = "its start" if run.baseline.sdk_seen else "where its script resumes (its own snapshot, if any)"
            note = f"{note}: the job restarts from {start}"
            return StepResult(Restored(skipped=skipped, before_step=before, note=note))
        pinned = await self.deps.registry.pin(run.restore.checkpoint_id, holder=run.recovery_id, ttl_s=PIN_TTL_S)
        ref = CheckpointRef(id=run.restore.checkpoint_id, step=run.restore.step, path=run.restore.path)
        checked = run.restore.digests_checked
        restored = Restored(
            checkpoint=ref, pinned=pinned, skipped=skipped, digests_checked=checked, before_step=before, note=rollback
        )
        return StepResult(restored)

    @staticmethod
    async def _registry(call: Callable[[], Awaitable[T]]) -> T:
        """A registry call, retried with backoff over about 15 s; RegistryUnavailableError when it never answers."""
        for attempt in range(6):
            try:
                return await call()
            except RegistryUnavailableError:
                if attempt == 5:
                    raise
                await asyncio.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")

    def _count_progress(self, run: RecoveryRun) -> None:
        """Record on the job whether this recovery restores a newer checkpoint than the one before (idempotent). A job
        that reports neither steps nor checkpoints (a plain script keeping its own snapshot) shows no progress Reprise
        could count: it is not counted, and its loops end by the same-error streak and the restart budget."""
        before = run.baseline.last_restore_step
        step = run.restore.step if run.restore else None
        if step is None and before is None and not run.baseline.sdk_seen:
            return
        progress = (step if step is not None else -1) > (before if before is not None else -1)
        values: dict[str, Any] = {"last_restore_step": step if step is not None else before}
        values["no_progress_streak"] = 0 if progress else run.baseline.no_progress_streak + 1
        if progress:
            values["same_error_streak"] = 1
        with Session(self.deps.engine) as session:
            if not jobs.update_fenced(session, job_id=run.job.id, fence=run.handle.fence, **values):
                raise FencedOutError("job taken over while restoring")

    async def launch(self, run: RecoveryRun) -> StepResult:
        """Publish the placement and have the backend launch a new restart epoch with a new master port."""
        epoch = run.job.restart_epoch + 1
        rendezvous = rendezvous_for(
            run.ranks,
            job_id=run.job.id,
            epoch=epoch,
            inventory=self.deps.inventory,
            port_base=self.deps.settings.master_port_base,
            engine=self.deps.engine,
        )
        unfetched = await self._fetch_restore_files(run, epoch)
        if unfetched is not None:
            return unfetched
        try:
            answers = await launch(
                self.deps.bus,
                self.deps.compute,
                operation_id=run.operation,
                job_id=run.job.id,
                fence=run.handle.fence,
                spec=run.job.job_spec(),
                ranks=run.ranks,
                rendezvous=rendezvous,
                restore=run.restore,
                skip_steps=facts.skipped_steps(run.incident, run.policy),
            )
        except BusError as exc:  # the placement could not be published, so nothing was launched: try again
            return StepResult(Launched(restart_epoch=epoch, error=str(exc)), Then.RETRY, detail=str(exc))
        if answers.stale:
            raise FencedOutError("a node refused our fence as stale")
        refused = checkpoints.refused_restore(answers)
        if refused is not None and run.restore is not None:  # its files differ: never loaded, the next attempt skips it
            detail = f"the restored checkpoint was refused before launch by {refused}"
            await self.deps.registry.load_failed(run.restore.checkpoint_id, reason=detail)
            return StepResult(Launched(restart_epoch=epoch, error=refused), Then.RETRY, detail=detail)
        in_place = sum(len(a.reply.data.in_place) for a in answers.items if a.reply is not None and a.ok)
        data = Launched(
            restart_epoch=epoch, master_port=rendezvous.master_port, answers=answers.record(), in_place=in_place
        )
        if not answers.all_done:
            return StepResult(data, Then.RETRY, detail="launch not confirmed by every node")
        self._record_launch(run, epoch, rendezvous)
        return StepResult(data)

    async def _fetch_restore_files(self, run: RecoveryRun, epoch: int) -> StepResult | None:
        """The restore's file list, fetched again when the recovery resumed past restoring; a retry when the registry
        does not answer (None: the launch may go on)."""
        restore = run.restore
        if restore is not None and restore.files is None and not restore.digests_checked:  # resumed past restoring
            try:
                files = await self._registry(lambda: self.deps.registry.restore_files(restore.checkpoint_id))
            except RegistryUnavailableError as exc:
                return StepResult(Launched(restart_epoch=epoch, error=str(exc)), Then.RETRY, detail=str(exc))
            run.restore = dataclasses.replace(restore, files=files)
        return None

    def _record_launch(self, run: RecoveryRun, epoch: int, rendezvous: Rendezvous) -> None:
        """Write the new epoch, its rendezvous, placement and restart to the job (fenced), and to the run's copy."""
        launched: dict[str, Any] = {
            "restart_epoch": epoch,
            "master_port": rendezvous.master_port,
            "master_addr": rendezvous.master_addr,
            "placement": run.ranks,
            "reserved_nodes": [],
            "restarts": run.job.restarts + 1,
            "restart_times": [*run.job.restart_times, self.deps.clock.now()][-RESTART_TIMES_KEPT:],
        }
        with Session(self.deps.engine) as session:
            if not jobs.update_fenced(session, job_id=run.job.id, fence=run.handle.fence, **launched):
                raise FencedOutError("job taken over during launch")
        for name, value in launched.items():  # the job as it now is, without reading it back
            setattr(run.job, name, value)

    async def verify(self, run: RecoveryRun) -> StepResult:
        """Wait until the new epoch proves it trains (recoveries/verify.py): every rank past the restored step (a job
        with the SDK), alive and working past the settle time (one without), or every rank exited 0 (finished).

        While it waits it looks for what the incident learned: a culprit found now (a second fault of the same storm)
        means a new attempt without that node.
        """
        what = verifying.Watch(
            job_id=run.job.id,
            epoch=run.job.restart_epoch,
            wanted=frozenset(r.rank for r in run.ranks),
            target=run.restore.step if run.restore else 0,
            policy=run.policy,
            sdk_seen=run.baseline.sdk_seen,
        )
        found = await verifying.watch(
            self.deps.inventory, self.deps.clock, what, news_event=run.news, news=lambda: self.news(run)
        )
        if found.verdict is verifying.Verdict.DEAD:
            return await self._verify_failed(run, what, found.data)
        return StepResult(found.data, found.then, detail=found.detail)

    async def _verify_failed(self, run: RecoveryRun, what: verifying.Watch, data: Verified) -> StepResult:
        """A rank of the new epoch exited other than 0: a new attempt; when the job reports steps and none of the dead
        ranks reported one, restoring the checkpoint failed (without steps, no one can tell)."""
        dead = data.dead_ranks
        seen = self.deps.inventory.ranks_of(what.job_id, restart_epoch=what.epoch)
        never_stepped = all(r not in seen or seen[r].step is None for r in dead)
        if run.restore is not None and never_stepped and verifying.by_steps(what, seen):
            reason = f"ranks {dead} exited before their first step after restoring it (recovery {run.recovery_id})"
            failed = await self.deps.registry.load_failed(run.restore.checkpoint_id, reason=reason)
            data = data.model_copy(update={"load_failed": failed})
        return StepResult(data, Then.RETRY, detail=f"ranks {dead} exited while the recovery was verified")
