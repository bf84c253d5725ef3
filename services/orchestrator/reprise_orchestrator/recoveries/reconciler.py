"""The reconciler: level-triggered, it resumes every unfinished recovery whose owner's lease has expired.

It also completes running jobs whose ranks of the current launch all exited 0 (stopping what is left of them and
telling the detector the job runs nowhere now), and stops the ranks of superseded launches on nodes that came back
(jobs/strays.py).

Each replica runs one. A recovery's owner holds the job's lock for as long as it runs and renews it; a lock that can
be taken while the recovery is unfinished means its owner died, paused past its lease, or shut down and let it go.
Taking the lock draws a new fence, which fences the old owner out of SQL and out of the nodes; the recovery then
runs on in this replica's runner, through the same path as a fresh claim.

Each pass first keeps the fence floor (recoveries/fences.py): the first pass of a replica, and any pass that finds
the lock store lost its data since, floors every job's fencing counter to the fence SQL holds. A pass that finds
the store unreachable is skipped with a warning (once per outage); the next one tries again.
"""

from __future__ import annotations

import asyncio

from sqlmodel import Session

from reprise_common.aio import raise_if_cancelled
from reprise_common.logging import get_logger
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.jobs import flows as job_flows
from reprise_orchestrator.jobs.strays import Strays
from reprise_orchestrator.locks import LockStoreUnavailableError
from reprise_orchestrator.recoveries import service
from reprise_orchestrator.recoveries.fences import FenceFloor
from reprise_orchestrator.recoveries.runner import RecoveryRunner

log = get_logger("reprise.orchestrator.reconciler")


class Reconciler:
    """Finds orphaned recoveries every interval and hands each to the runner."""

    def __init__(self, deps: Deps, runner: RecoveryRunner, *, interval_s: float) -> None:
        self.deps = deps
        self.runner = runner
        self.interval_s = interval_s
        self.resumed = 0
        self.floor = FenceFloor(deps)
        self.strays = Strays(deps)
        self._store_away = False

    async def run(self) -> None:
        """Reconcile until cancelled; an error in one pass is logged and the next pass runs."""
        while True:
            try:
                await self.tick()
            except LockStoreUnavailableError as exc:
                if not self._store_away:
                    log.warning("lock store unreachable: reconcile passes wait for it", extra={"error": str(exc)})
                self._store_away = True
            except Exception:
                raise_if_cancelled()
                log.exception("reconcile pass failed")
            raise_if_cancelled()  # redis-py retries a read its cancel interrupted: the pass can end as if not cancelled
            await asyncio.sleep(self.interval_s)

    async def tick(self) -> int:
        """One pass: keep the fence floor, complete finished jobs, resume what can be taken over; returns how many
        recoveries it took."""
        await self.floor.keep()
        if self._store_away:
            log.info("lock store reachable again")
            self._store_away = False
        await job_flows.complete_finished(self.deps)
        self.strays.tick()
        with Session(self.deps.engine) as session:
            active = service.get_all_active_ids(session)
        running = self.runner.running
        taken = 0
        for recovery_id, job_id in active:
            if recovery_id in running:
                continue
            if not self.runner.has_room():
                break  # the rest waits for a free slot here or for another replica
            handle = await self.deps.locks.acquire(job_id, owner=self.deps.settings.replica_id)
            if handle is None:
                continue  # its owner is alive and holds the lease
            if not self.runner.start(handle, recovery_id):
                await self.deps.locks.release(handle)
                continue
            taken += 1
            self.resumed += 1
            log.info("resuming an orphaned recovery", extra={"recovery_id": recovery_id, "job_id": job_id})
        return taken
