"""Per-job locks with fencing tokens, in Redis.

A lock alone is not safe across pauses or expiry, so each acquisition also takes a fencing token from a
monotonically increasing counter; the SQL rows and the agents refuse anything that carries a lower token.
One handle object per acquisition: its token is never shared between tasks.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Protocol, cast

from redis.asyncio import Redis

_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end
"""
_EXTEND = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end
"""


@dataclass(frozen=True)
class LockHandle:
    """One acquisition of a job's lock."""

    job_id: str
    token: str
    fence: int


class JobLocks(Protocol):
    """The lock interface the orchestrator depends on: leased per-job locks, each acquisition with a new fence."""

    async def acquire(self, job_id: str, *, owner: str) -> LockHandle | None:
        """Take the job's lock if it is free, with a fence higher than any before; None when someone holds it."""
        ...

    async def extend(self, handle: LockHandle) -> bool:
        """Renew the lease; False when the lock is no longer ours."""
        ...

    async def release(self, handle: LockHandle) -> bool:
        """Let the lock go if it is still ours."""
        ...

    async def next_fence(self, job_id: str) -> int:
        """A fence without the lock, fencing out whoever holds it (cancel preempts a running recovery)."""
        ...

    async def floor_fence(self, job_id: str, at_least: int) -> None:
        """Never issue a fence at or below one already used (after the lock store lost its data)."""
        ...


class RedisJobLocks:
    """SET NX PX locks plus an INCR fencing counter per job."""

    def __init__(self, redis: Redis, *, ttl_s: float, prefix: str = "reprise") -> None:
        self.redis = redis
        self.ttl_ms = int(ttl_s * 1000)
        self.prefix = prefix

    def _lock_key(self, job_id: str) -> str:
        return f"{self.prefix}:lock:job:{job_id}"

    def _fence_key(self, job_id: str) -> str:
        return f"{self.prefix}:fence:job:{job_id}"

    async def acquire(self, job_id: str, *, owner: str) -> LockHandle | None:
        """Take the lock if free; the fence is drawn only after the lock is ours."""
        token = f"{owner}:{secrets.token_hex(8)}"
        if not await self.redis.set(self._lock_key(job_id), token, nx=True, px=self.ttl_ms):
            return None
        fence = int(await self.redis.incr(self._fence_key(job_id)))
        return LockHandle(job_id=job_id, token=token, fence=fence)

    async def next_fence(self, job_id: str) -> int:
        """A fence without the lock: whoever holds it now is fenced out (cancel preempts a running recovery)."""
        return int(await self.redis.incr(self._fence_key(job_id)))

    async def floor_fence(self, job_id: str, at_least: int) -> None:
        """Never let the counter fall below a fence already used (e.g. after Redis lost its data)."""
        key = self._fence_key(job_id)
        current = int(await self.redis.get(key) or 0)
        if current < at_least:
            await self.redis.set(key, at_least)

    async def extend(self, handle: LockHandle) -> bool:
        """Renew the lease; False means the lock is no longer ours."""
        result = await cast(
            "object", self.redis.eval(_EXTEND, 1, self._lock_key(handle.job_id), handle.token, self.ttl_ms)
        )  # type: ignore[misc]
        return bool(result)

    async def release(self, handle: LockHandle) -> bool:
        """Release only if still ours."""
        result = await cast("object", self.redis.eval(_RELEASE, 1, self._lock_key(handle.job_id), handle.token))  # type: ignore[misc]
        return bool(result)
