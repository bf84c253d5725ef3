"""The fence floor: the lock store's fencing counters never fall behind the fences SQL already holds.

Redis may lose its data (FLUSHALL, a restart without persistence, a failover to an empty replica): every counter
starts again at 1 while SQL keeps each job's highest fence and refuses any fence at or below it, so without a floor
every claim would be refused until the counter caught up. Two things keep the counters ahead (docs/orchestrator.md):

- the reconciler's passes (`FenceFloor.keep`): the first pass of a replica floors every job's counter to its SQL
  fence and leaves a mark in the store; a later pass that finds the mark gone (the store lost its data since) floors
  them all again;
- a claim or take-over that SQL refuses (`Refused`) floors that job's counter to the stored fence and draws a fresh
  fence under the lock it holds (`claim_under_fresh_fences`), up to FENCE_ATTEMPTS times, so it does not wait for
  the next pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import Counter
from sqlmodel import Session

from reprise_common.logging import get_logger
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.locks import LockHandle
from reprise_orchestrator.recoveries import service

log = get_logger("reprise.orchestrator.fences")
T = TypeVar("T")
FENCE_ATTEMPTS = 3  # a refused claim draws a fresh fence this many times at most (one suffices after a loss)
FENCES_BEHIND = Counter(
    "reprise_orchestrator_fences_behind_total",
    "Fences SQL refused because the lock store's counter was behind the stored fence (it lost its data)",
    ["where"],
)
FLOORS = Counter(
    "reprise_orchestrator_fence_floors_total", "Passes that floored every job's fencing counter from SQL", ["why"]
)


@dataclass(frozen=True)
class Refused:
    """SQL refused a fence: the job's stored fence is at or above it."""

    fence: int
    stored: int


class FenceFloor:
    """Floors every job's fencing counter from SQL at a replica's first pass and after the store lost its data."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self.floored_at_start = False
        self._due = True

    async def keep(self) -> bool:
        """Floor every counter when due (the first pass, a pass that failed, a store that lost the floor's mark);
        True when it floored. LockStoreUnavailableError when the store does not answer (the next pass tries again)."""
        if not self._due and await self.deps.locks.floored():
            return False
        why = "store_lost_data" if self.floored_at_start else "start"
        self._due = True
        await self.deps.locks.mark_floored()  # first: a loss during the pass takes the mark, and the next one floors
        with Session(self.deps.engine) as session:
            floors = service.stored_fences(session)
        await self.deps.locks.floor_fences(floors)
        self._due, self.floored_at_start = False, True
        FLOORS.labels(why).inc()
        level = log.info if why == "start" else log.warning
        level("fencing counters floored to the stored fences", extra={"why": why, "jobs": len(floors)})
        return True


async def claim_under_fresh_fences(
    deps: Deps, handle: LockHandle, claim: Callable[[LockHandle], T | Refused], *, where: str
) -> tuple[LockHandle | None, T | Refused]:
    """Claim under `handle`; while SQL refuses its fence, draw a fresh one under the same lock and claim again
    (FENCE_ATTEMPTS claims in all). The handle it ended with (None when the lock is no longer its own) and the last
    answer, which is still Refused when every attempt was."""
    answer = claim(handle)
    for _ in range(FENCE_ATTEMPTS - 1):
        if not isinstance(answer, Refused):
            break
        fresh = await refenced(deps, handle, answer, where=where)
        if fresh is None:
            return None, answer
        handle = fresh
        answer = claim(handle)
    return handle, answer


async def refenced(deps: Deps, handle: LockHandle, refused: Refused, *, where: str) -> LockHandle | None:
    """A fresh fence above the stored one for the lock `handle` holds; None when the lock is no longer its own."""
    fresh = await deps.locks.refence(handle, above=refused.stored)
    extra = {"job_id": handle.job_id, "refused": refused.fence, "stored": refused.stored, "where": where}
    if fresh is None:
        log.info("fence refused and the lock is gone: leaving the job to its owner", extra=extra)
        return None
    FENCES_BEHIND.labels(where).inc()
    log.warning(
        "fence counter was behind the stored fence: floored it, drew a fresh fence",
        extra=extra | {"fence": fresh.fence},
    )
    return fresh
