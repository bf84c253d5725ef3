"""Per-job locks with fencing tokens, in Redis.

A lock alone is not safe across pauses or expiry, so each acquisition also takes a fencing token from a
monotonically increasing counter; the SQL rows and the agents refuse anything that carries a lower token.
One handle object per acquisition: its token is never shared between tasks.

The store may lose its data (FLUSHALL, a restart without persistence, a failover to an empty replica): counters and
locks are gone while SQL still holds each job's highest fence. Callers floor the counters from SQL (`floor_fences`,
`refence`; recoveries/fences.py says when) so no fence is issued twice, and an owner whose lock vanished may take it
back only while nobody else holds it (`reacquire`). A store that does not answer raises LockStoreUnavailableError.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, cast

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from reprise_common.aio import raise_if_cancelled
from reprise_common.errors import RepriseError

_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end
"""
_EXTEND = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end
"""
_FLOOR = """
if tonumber(redis.call('get', KEYS[1]) or '0') < tonumber(ARGV[1]) then redis.call('set', KEYS[1], ARGV[1]) end
return 1
"""
# A fresh fence above ARGV[2] for the holder of the lock only: a caller that lost the lock draws nothing.
_REFENCE = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(redis.call('get', KEYS[2]) or '0') < tonumber(ARGV[2]) then redis.call('set', KEYS[2], ARGV[2]) end
return redis.call('incr', KEYS[2])
"""
# The lock back under the same token if nobody holds it, and the counter never below the fence it carries.
_REACQUIRE = """
if not redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
if tonumber(redis.call('get', KEYS[2]) or '0') < tonumber(ARGV[3]) then redis.call('set', KEYS[2], ARGV[3]) end
return 1
"""
FLOOR_BATCH = 500  # counters floored per round trip


class LockStoreUnavailableError(RepriseError):
    """The lock store did not answer (unreachable, timed out, still loading): whether a lock is held is unknown."""


@dataclass(frozen=True)
class LockHandle:
    """One acquisition of a job's lock; `leased_at` (monotonic) is when the request that took its lease was sent."""

    job_id: str
    token: str
    fence: int
    leased_at: float = field(default_factory=time.monotonic, compare=False)


class JobLocks(Protocol):
    """The lock interface the orchestrator depends on: leased per-job locks, each acquisition with a new fence."""

    async def acquire(self, job_id: str, *, owner: str) -> LockHandle | None:
        """Take the job's lock if it is free, with a fence higher than any before; None when someone holds it."""
        ...

    async def extend(self, handle: LockHandle) -> bool:
        """Renew the lease; False when the lock is no longer ours."""
        ...

    async def reacquire(self, handle: LockHandle) -> bool:
        """Take the lock back under the handle's token if nobody holds it (the store lost it); False otherwise."""
        ...

    async def release(self, handle: LockHandle) -> bool:
        """Let the lock go if it is still ours."""
        ...

    async def refence(self, handle: LockHandle, *, above: int) -> LockHandle | None:
        """A new fence above `above` for a lock still held (the counter was behind); None when it is not ours."""
        ...

    async def next_fence(self, job_id: str) -> int:
        """A fence without the lock, fencing out whoever holds it (cancel preempts a running recovery)."""
        ...

    async def floor_fence(self, job_id: str, at_least: int) -> None:
        """Never issue a fence at or below one already used (after the lock store lost its data)."""
        ...

    async def floor_fences(self, floors: Mapping[str, int]) -> None:
        """floor_fence for many jobs (job id → the highest fence used)."""
        ...

    async def floored(self) -> bool:
        """True while the store holds the mark `mark_floored` left; False once it lost its data since."""
        ...

    async def mark_floored(self) -> None:
        """Leave the mark that says the counters were floored from SQL."""
        ...


@contextmanager
def _answering(what: str) -> Iterator[None]:
    """Turn the store not answering into LockStoreUnavailableError (callers need not know it is Redis)."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise_if_cancelled()  # a cancel that landed in the socket read is a cancel, not the store going away
        raise LockStoreUnavailableError(f"the lock store did not answer ({what}): {exc}") from exc


class RedisJobLocks:
    """SET NX PX locks plus an INCR fencing counter per job."""

    def __init__(self, redis: Redis, *, ttl_s: float, prefix: str = "reprise") -> None:
        self.redis = redis
        self.ttl_s = ttl_s
        self.ttl_ms = int(ttl_s * 1000)
        self.prefix = prefix

    def _lock_key(self, job_id: str) -> str:
        return f"{self.prefix}:lock:job:{job_id}"

    def _fence_key(self, job_id: str) -> str:
        return f"{self.prefix}:fence:job:{job_id}"

    @property
    def _mark_key(self) -> str:
        return f"{self.prefix}:fences:floored"

    async def _eval(self, script: str, keys: list[str], *args: str | int) -> int:
        result = await cast("object", self.redis.eval(script, len(keys), *keys, *args))  # type: ignore[misc]
        return int(cast("int", result))

    async def acquire(self, job_id: str, *, owner: str) -> LockHandle | None:
        """Take the lock if free; the fence is drawn only after the lock is ours."""
        token = f"{owner}:{secrets.token_hex(8)}"
        asked = time.monotonic()
        with _answering("acquire"):
            if not await self.redis.set(self._lock_key(job_id), token, nx=True, px=self.ttl_ms):
                return None
            fence = int(await self.redis.incr(self._fence_key(job_id)))
        return LockHandle(job_id=job_id, token=token, fence=fence, leased_at=asked)

    async def next_fence(self, job_id: str) -> int:
        """A fence without the lock: whoever holds it now is fenced out (cancel preempts a running recovery)."""
        with _answering("next fence"):
            return int(await self.redis.incr(self._fence_key(job_id)))

    async def refence(self, handle: LockHandle, *, above: int) -> LockHandle | None:
        """Floor the counter at `above` and draw from it, in one script, only while the lock is the handle's."""
        keys = [self._lock_key(handle.job_id), self._fence_key(handle.job_id)]
        with _answering("refence"):
            fence = await self._eval(_REFENCE, keys, handle.token, above)
        if not fence:
            return None
        return LockHandle(job_id=handle.job_id, token=handle.token, fence=fence, leased_at=handle.leased_at)

    async def floor_fence(self, job_id: str, at_least: int) -> None:
        """Never let the counter fall below a fence already used (e.g. after Redis lost its data); atomic, so a
        floor never lowers a counter that moved on meanwhile."""
        await self.floor_fences({job_id: at_least})

    async def floor_fences(self, floors: Mapping[str, int]) -> None:
        """Floor many counters, FLOOR_BATCH per round trip."""
        items = list(floors.items())
        with _answering("floor fences"):
            for start in range(0, len(items), FLOOR_BATCH):
                async with self.redis.pipeline(transaction=False) as pipe:
                    for job_id, at_least in items[start : start + FLOOR_BATCH]:
                        pipe.eval(_FLOOR, 1, self._fence_key(job_id), at_least)
                    await pipe.execute()

    async def floored(self) -> bool:
        """True while the mark of the last floor is still there."""
        with _answering("floor mark"):
            return bool(await self.redis.exists(self._mark_key))

    async def mark_floored(self) -> None:
        """Leave the floor mark (no expiry: only a loss of the store's data removes it)."""
        with _answering("floor mark"):
            await self.redis.set(self._mark_key, "1")

    async def extend(self, handle: LockHandle) -> bool:
        """Renew the lease; False means the lock is no longer ours."""
        with _answering("extend"):
            return bool(await self._eval(_EXTEND, [self._lock_key(handle.job_id)], handle.token, self.ttl_ms))

    async def reacquire(self, handle: LockHandle) -> bool:
        """SET NX the handle's token again, with the counter floored at its fence (the store lost the lock)."""
        keys = [self._lock_key(handle.job_id), self._fence_key(handle.job_id)]
        with _answering("reacquire"):
            return bool(await self._eval(_REACQUIRE, keys, handle.token, self.ttl_ms, handle.fence))

    async def release(self, handle: LockHandle) -> bool:
        """Release only if still ours."""
        with _answering("release"):
            return bool(await self._eval(_RELEASE, [self._lock_key(handle.job_id)], handle.token))
