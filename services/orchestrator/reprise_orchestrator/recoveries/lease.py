"""A running recovery's lease on its job's lock, renewed every third of the lease while the recovery runs.

A renewal ends one of three ways:

- the store answers and the lock is the run's: the lease runs on from the time the renewal was sent;
- the store answers and the lock is not the run's: it vanished (the store lost its data) or another owner holds it.
  The run takes it back under its own token only if nobody holds it, and keeps it only if SQL still names the run's
  fence: whoever replaces an owner claims a higher fence in SQL before it acts, so a lock nobody holds and a fence
  still the job's highest mean nobody replaced the run. Otherwise the lease is lost;
- the store does not answer (LockStoreUnavailableError): the renewal is retried, RETRIES_PER_LEASE times a lease,
  until the lease would run out before the next try; then it is lost.

A lost lease sets the run's `lock_lost`: the flow stands down before its next step and the reconciler of some replica
(this one included) resumes the recovery from its last persisted step once it can take the lock. Whatever the old
owner still sends carries its old fence, which SQL and the agents refuse once the new owner claimed a higher one.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Counter
from sqlmodel import Session

from reprise_common.aio import raise_if_cancelled
from reprise_common.logging import get_logger
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.locks import LockStoreUnavailableError
from reprise_orchestrator.recoveries import service
from reprise_orchestrator.recoveries.run import RecoveryRun

log = get_logger("reprise.orchestrator.lease")
RETRIES_PER_LEASE = 10  # a renewal the store did not answer is tried again after a tenth of the lease
LEASES_LOST = Counter("reprise_orchestrator_leases_lost_total", "Recovery leases lost while running", ["why"])
LOCKS_RETAKEN = Counter(
    "reprise_orchestrator_locks_retaken_total", "Job locks a running recovery took back after the lock store lost them"
)


class Lease:
    """Keeps running recoveries' leases (one `keep` task per run)."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps

    async def keep(self, run: RecoveryRun) -> None:
        """Renew the run's lease until cancelled; set `run.lock_lost` and return once it is lost."""
        ttl = self.deps.settings.lock_ttl_s
        expires = run.handle.leased_at + ttl
        pause = ttl / 3
        while True:
            await asyncio.sleep(pause)
            sent = time.monotonic()
            try:
                held = await self._renew(run)
                raise_if_cancelled()  # a cancel the store client retried past is still a cancel
            except LockStoreUnavailableError as exc:
                pause = ttl / RETRIES_PER_LEASE
                left = expires - time.monotonic()
                if left <= pause:
                    self._lose(run, "store_unavailable", error=str(exc))
                    return
                extra = {"job_id": run.job.id, "left_s": round(left, 2), "error": str(exc)}
                log.warning("lease renewal failed; trying again within the lease", extra=extra)
                continue
            except Exception:  # a renewal that cannot tell must not leave the run acting without a lease
                log.exception("lease renewal failed unexpectedly", extra={"job_id": run.job.id})
                self._lose(run, "renewal_error")
                return
            if not held:
                self._lose(run, "lock_not_ours")
                return
            expires, pause = sent + ttl, ttl / 3

    async def _renew(self, run: RecoveryRun) -> bool:
        """Extend the lease, or take back a lock the store lost while SQL still names the run's fence."""
        locks = self.deps.locks
        if await locks.extend(run.handle):
            return True
        if not await locks.reacquire(run.handle):
            return False  # another owner holds it
        with Session(self.deps.engine) as session:
            stored = service.stored_fence(session, job_id=run.job.id)
        extra = {"job_id": run.job.id, "recovery_id": run.recovery_id, "fence": run.handle.fence, "stored": stored}
        if stored == run.handle.fence:
            LOCKS_RETAKEN.inc()
            log.warning("took back a job lock the lock store had lost; the recovery runs on", extra=extra)
            return True
        await locks.release(run.handle)  # a newer owner claimed the job: it may take the lock
        return False

    def _lose(self, run: RecoveryRun, why: str, **facts: str) -> None:
        LEASES_LOST.labels(why).inc()
        extra = {"job_id": run.job.id, "recovery_id": run.recovery_id, "why": why, **facts}
        log.warning("lease lost: standing down before the next step; the reconciler resumes the recovery", extra=extra)
        run.lock_lost.set()
