"""Strays: ranks of a superseded launch still alive on a node that came back.

A node cut off from the control plane while its job was recovered without it keeps its old ranks: the recovery's stop
could not reach it. When its agent reports again, those ranks show under an older restart epoch (or under a job that
has ended). They are stopped by the job's highest fence, which the agent has not seen yet, so they cannot write into
the new epoch; a later launch on that node draws a higher fence still and is not refused. A node of the job's current
placement is left alone (stopping a job stops all its ranks on a node), and so is a job being recovered (its
recovery stops what it must). Each stray is told once a while (RESEND_S); a stop that did not reach its node (cut off
while its last report still looked fresh) is sent again as soon as the node reports. The commands run beside the
reconciler's pass, not in it.
"""

from __future__ import annotations

import asyncio

from sqlmodel import Session

from reprise_common.logging import get_logger
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.jobs import service
from reprise_orchestrator.jobs.models import JobState

log = get_logger("reprise.orchestrator.strays")
RESEND_S = 30.0  # a stray still reported alive this long after its stop is told again
LIVE_STATES = frozenset({JobState.PENDING, JobState.RUNNING, JobState.HELD})  # a launch of the current epoch belongs


class Strays:
    """Finds the strays in the inventory at each reconciler pass and stops them."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self._told: dict[tuple[str, int | None, str], float] = {}  # (job, epoch, node) -> when its stop was sent
        self._tasks: set[asyncio.Task[None]] = set()

    def find(self) -> dict[tuple[str, int | None], tuple[set[str], int]]:
        """Each superseded launch with alive ranks: the nodes to stop it on, and the fence to stop it with."""
        live = self.deps.inventory.live_launches()
        if not live:
            return {}
        with Session(self.deps.engine) as session:
            jobs = service.get_launches(session, job_ids={job_id for job_id, _ in live})
            found: dict[tuple[str, int | None], tuple[set[str], int]] = {}
            for (job_id, epoch), alive_on in live.items():
                known = jobs.get(job_id)
                if known is None or known[0] is JobState.RECOVERING:
                    continue  # not Reprise's launch, or its recovery is under way
                state, current, fence = known
                if state in LIVE_STATES and epoch == current:
                    continue
                placed = set(service.get(session, job_id=job_id).nodes()) if state in LIVE_STATES else set()
                if nodes := alive_on - placed:
                    found[(job_id, epoch)] = (nodes, fence)
        return found

    def tick(self) -> int:
        """Stop the strays not told lately; how many stops were sent."""
        now = self.deps.clock.monotonic()
        self._told = {key: at for key, at in self._told.items() if now - at < RESEND_S}  # gone, or due again
        sent = 0
        for (job_id, epoch), (nodes, fence) in self.find().items():
            due = sorted(n for n in nodes if (job_id, epoch, n) not in self._told)
            if not due:
                continue
            for node_id in due:
                self._told[(job_id, epoch, node_id)] = now
            log.warning(
                "stopping ranks of a superseded launch on nodes that came back",
                extra={"job_id": job_id, "restart_epoch": epoch, "nodes": due, "fence": fence},
            )
            task = asyncio.create_task(self._stop(job_id, epoch, due, fence), name=f"strays-{job_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            sent += len(due)
        return sent

    async def _stop(self, job_id: str, epoch: int | None, nodes: list[str], fence: int) -> None:
        operation = f"{job_id}:strays:{epoch}:{fence}"
        try:
            answers = await self.deps.compute.stop(job_id, nodes, operation_id=operation, fence=fence)
        except Exception:
            log.exception("stopping stray ranks failed", extra={"job_id": job_id, "nodes": nodes})
            unreached = nodes
        else:
            unreached = [a.node_id for a in answers.items if not a.ok and not a.stale]
        for node_id in unreached:  # told again at the first pass that finds it fresh, not a resend period later
            self._told.pop((job_id, epoch, node_id), None)
