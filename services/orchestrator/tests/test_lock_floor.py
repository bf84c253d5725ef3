"""The lock store losing its data, against a real Redis-compatible server: floors, fresh fences, locks taken back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from reprise_cli.redis_server import RedisServer
from reprise_orchestrator.locks import LockStoreUnavailableError, RedisJobLocks


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url, socket_timeout=2.0, socket_connect_timeout=2.0)
    yield client
    await client.aclose()


async def test_a_floor_never_lowers_a_counter_and_floors_many_at_once(redis: Redis) -> None:
    locks = RedisJobLocks(redis, ttl_s=5)
    for _ in range(9):
        await locks.next_fence("job-ahead")
    await locks.floor_fences({"job-ahead": 5, "job-behind": 41, "job-new": 7})
    assert await locks.next_fence("job-ahead") == 10  # 9 was already drawn: a floor of 5 changes nothing
    assert await locks.next_fence("job-behind") == 42
    assert await locks.next_fence("job-new") == 8


async def test_the_floor_mark_goes_with_the_stores_data(redis: Redis) -> None:
    locks = RedisJobLocks(redis, ttl_s=5)
    assert not await locks.floored()
    await locks.mark_floored()
    assert await locks.floored()
    await redis.flushall()
    assert not await locks.floored()


async def test_only_the_holder_draws_a_fresh_fence_above_the_stored_one(redis: Redis) -> None:
    locks = RedisJobLocks(redis, ttl_s=5)
    await redis.flushall()  # the store lost the counter: the next lock comes with fence 1
    handle = await locks.acquire("job-1", owner="a")
    assert handle is not None and handle.fence == 1
    fresh = await locks.refence(handle, above=30)  # SQL holds 30
    assert fresh is not None and fresh.fence == 31 and fresh.token == handle.token
    assert await locks.extend(fresh) and await locks.release(fresh)

    other = await locks.acquire("job-1", owner="b")
    assert other is not None and other.fence == 32
    assert await locks.refence(handle, above=40) is None  # not the holder: it draws nothing
    assert await locks.next_fence("job-1") == 33


async def test_a_lock_the_store_lost_is_taken_back_only_while_nobody_holds_it(redis: Redis) -> None:
    locks = RedisJobLocks(redis, ttl_s=5)
    for _ in range(6):
        await locks.next_fence("job-2")
    owner = await locks.acquire("job-2", owner="a")
    assert owner is not None and owner.fence == 7
    await redis.flushall()
    assert not await locks.extend(owner)

    assert await locks.reacquire(owner)
    assert await locks.extend(owner)  # the same handle holds it again
    assert await locks.next_fence("job-2") == 8  # the counter came back no lower than the owner's fence

    await redis.flushall()
    rival = await locks.acquire("job-2", owner="b")
    assert rival is not None
    assert not await locks.reacquire(owner)  # someone holds it: the owner must stand down
    assert not await locks.extend(owner)
    assert await locks.extend(rival)


async def test_a_store_that_does_not_answer_raises_the_lock_error(redis_server: RedisServer) -> None:
    client = Redis.from_url(redis_server.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    locks = RedisJobLocks(client, ttl_s=5)
    handle = await locks.acquire("job-3", owner="a")
    assert handle is not None
    redis_server.stop()
    try:
        for attempt in (locks.extend(handle), locks.acquire("job-4", owner="a"), locks.floored()):
            with pytest.raises(LockStoreUnavailableError):
                await asyncio.wait_for(attempt, timeout=10)
    finally:
        redis_server.start()
    assert await locks.acquire("job-5", owner="a") is not None  # the same client, once the store is back
    await client.aclose()
