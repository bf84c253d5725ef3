"""Job locks and fencing tokens against a real Redis-compatible server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from reprise_cli.redis_server import RedisServer
from reprise_orchestrator.locks import RedisJobLocks


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def test_only_one_holder_and_fences_increase(redis: Redis) -> None:
    locks = RedisJobLocks(redis, ttl_s=5)
    results = await asyncio.gather(*(locks.acquire("job-1", owner=f"r{i}") for i in range(20)))
    holders = [h for h in results if h is not None]
    assert len(holders) == 1
    first = holders[0]
    assert await locks.release(first)
    second = await locks.acquire("job-1", owner="r-next")
    assert second is not None and second.fence > first.fence


async def test_release_and_extend_only_by_the_token_holder(redis: Redis) -> None:
    locks = RedisJobLocks(redis, ttl_s=0.2)
    old = await locks.acquire("job-2", owner="a")
    assert old is not None
    await asyncio.sleep(0.4)  # lease expires
    new = await locks.acquire("job-2", owner="b")
    assert new is not None and new.fence > old.fence
    assert not await locks.extend(old)
    assert not await locks.release(old)
    assert await locks.extend(new)
    assert await redis.get("reprise:lock:job:job-2") == new.token.encode()


async def test_fence_floor_survives_a_counter_reset(redis: Redis) -> None:
    locks = RedisJobLocks(redis, ttl_s=5)
    await redis.delete("reprise:fence:job:job-3")
    await locks.floor_fence("job-3", 41)
    handle = await locks.acquire("job-3", owner="a")
    assert handle is not None and handle.fence == 42
