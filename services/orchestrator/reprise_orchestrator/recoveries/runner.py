"""The replica's recoveries, side by side: one supervised task each, at most `limit` at once.

Whoever claims a recovery (the incident consumer) or finds an orphan (the reconciler) hands it over with the lock
handle it took; the task drives it (RecoveryFlow.run) and releases the lock when it ends. At shutdown every task is
cancelled and its lock released, so the reconciler of another replica resumes each from its last persisted step
within one reconcile interval instead of waiting for the lease to run out.
"""

from __future__ import annotations

import asyncio
import contextlib

from reprise_common.logging import get_logger
from reprise_orchestrator.locks import JobLocks, LockHandle, LockStoreUnavailableError
from reprise_orchestrator.recoveries.flows import RecoveryFlow, Started

log = get_logger("reprise.orchestrator.runner")


class RecoveryRunner:
    """Runs recoveries in tasks of their own, bounded."""

    def __init__(self, flow: RecoveryFlow, locks: JobLocks, *, limit: int) -> None:
        self.flow = flow
        self.locks = locks
        self.limit = limit
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping = False

    @property
    def running(self) -> frozenset[str]:
        """The ids of the recoveries this replica runs now."""
        return frozenset(self._tasks)

    def has_room(self) -> bool:
        """True when another recovery may start here."""
        return not self._stopping and len(self._tasks) < self.limit

    def start(self, handle: LockHandle, recovery_id: str, claimed: Started | None = None) -> bool:
        """Drive the recovery in a task of its own, which owns `handle` from now on; False (the caller keeps the
        handle) when the runner is full, stopping, or already runs it. A fresh claim hands over what it wrote."""
        if not self.has_room() or recovery_id in self._tasks:
            return False
        task = asyncio.create_task(self._run(handle, recovery_id, claimed), name=f"recovery:{recovery_id}")
        self._tasks[recovery_id] = task
        return True

    async def _run(self, handle: LockHandle, recovery_id: str, claimed: Started | None) -> None:
        try:
            await self.flow.run(handle, recovery_id, claimed)
        except asyncio.CancelledError:
            log.info("recovery left to another replica", extra={"recovery_id": recovery_id})
            raise
        except LockStoreUnavailableError as exc:  # while taking it over: nothing was done under the new fence
            extra = {"recovery_id": recovery_id, "error": str(exc)}
            log.warning("lock store unreachable; the reconciler resumes the recovery", extra=extra)
        except Exception:
            log.exception("recovery task failed; the reconciler will resume it", extra={"recovery_id": recovery_id})
        finally:
            self._tasks.pop(recovery_id, None)
            try:
                await self.locks.release(handle)
            except Exception as exc:  # Redis away: the lock expires with its lease, and then others may take it
                log.warning("could not release a job lock", extra={"job_id": handle.job_id, "error": repr(exc)})

    async def stop(self) -> None:
        """Cancel every recovery task (each releases its lock) and wait for them."""
        self._stopping = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
