"""The reconciler: level-triggered, it resumes every unfinished recovery whose owner's lease has expired.

It also completes running jobs whose ranks of the current launch all exited 0 (stopping what is left of them and
telling the detector the job runs nowhere now).

Each replica runs one. A recovery's owner holds the job's lock for as long as it runs and renews it; a lock that can
be taken while the recovery is unfinished means its owner died or paused past its lease. Taking the lock draws a new
fence, which fences the old owner out of SQL and out of the agents.
"""

from __future__ import annotations

import asyncio
import contextlib

from sqlmodel import Session

from reprise_common.logging import get_logger
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.jobs import flows as job_flows
from reprise_orchestrator.locks import LockHandle
from reprise_orchestrator.recoveries import service
from reprise_orchestrator.recoveries.flows import RecoveryFlow

log = get_logger("reprise.orchestrator.reconciler")


class Reconciler:
    """Finds orphaned recoveries every interval and resumes each in its own task."""

    def __init__(self, deps: Deps, flow: RecoveryFlow, *, interval_s: float) -> None:
        self.deps = deps
        self.flow = flow
        self.interval_s = interval_s
        self._tasks: set[asyncio.Task[None]] = set()
        self.resumed = 0

    async def run(self) -> None:
        """Reconcile until cancelled; an error in one pass is logged and the next pass runs."""
        try:
            while True:
                try:
                    await self.tick()
                except Exception:
                    log.exception("reconcile pass failed")
                await asyncio.sleep(self.interval_s)
        finally:
            for task in list(self._tasks):
                task.cancel()
            for task in list(self._tasks):
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def tick(self) -> int:
        """One pass: complete finished jobs, resume what can be taken over; returns how many recoveries it took."""
        await job_flows.complete_finished(self.deps)
        with Session(self.deps.engine) as session:
            active = service.get_all_active_ids(session)
        orphans = [(recovery_id, job_id) for recovery_id, job_id in active if recovery_id not in self.flow.running]
        taken = 0
        for recovery_id, job_id in orphans:
            handle = await self.deps.locks.acquire(job_id, owner=self.deps.settings.replica_id)
            if handle is None:
                continue  # its owner is alive and holds the lease
            taken += 1
            self.resumed += 1
            task = asyncio.create_task(self._resume(handle, recovery_id), name=f"resume:{recovery_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return taken

    async def _resume(self, handle: LockHandle, recovery_id: str) -> None:
        try:
            await self.flow.resume(handle, recovery_id)
        except Exception:
            log.exception("resuming a recovery failed", extra={"recovery_id": recovery_id})
        finally:
            await self.deps.locks.release(handle)
