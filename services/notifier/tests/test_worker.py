"""A destination's worker step by step with an injected clock: pacing, Retry-After across a restart, backoff, expiry.

The worker talks to the real receiver over HTTP and keeps its state in a real SQLite file; only time is moved by
hand, so no test sleeps through a Retry-After.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import SecretStr
from sqlalchemy.engine import Engine
from sqlmodel import Session

from reprise_cli.slack_receiver import SlackReceiver
from reprise_common.clock import ManualClock
from reprise_common.db import make_engine, session_scope
from reprise_notifier import schema
from reprise_notifier.alerts.models import Alert, AlertKind
from reprise_notifier.deliveries import service
from reprise_notifier.deliveries.flows import DeliveryPolicy, Worker, backoff_s
from reprise_notifier.deliveries.models import Delivery, DeliveryState, SendResult, WaitReason, delivery_id
from reprise_notifier.deliveries.transport import Transport, classify, parse_retry_after, scrub
from reprise_notifier.routing import Destination, DestinationKind

NAME = "ops"


@pytest.fixture
def engine(sqlite_url: str) -> Iterator[Engine]:
    """The notifier's tables in a fresh SQLite file."""
    found = make_engine(sqlite_url)
    schema.upgrade(found)
    yield found
    found.dispose()


@pytest.fixture
def clock() -> ManualClock:
    """Time that moves only when the test says."""
    return ManualClock(datetime(2026, 1, 1, tzinfo=UTC))


def _queue(engine: Engine, clock: ManualClock, count: int, *, start: int = 0) -> list[str]:
    ids = []
    with session_scope(engine) as session:
        for index in range(start, start + count):
            alert = Alert(event_id=f"e-{index}", kind=AlertKind.OPENED, job_id=f"job-{index}", occurred_at=clock.now())
            key = delivery_id(alert.event_id, NAME)
            session.add(
                Delivery(
                    id=key,
                    event_id=alert.event_id,
                    destination=NAME,
                    kind=alert.kind.value,
                    job_id=alert.job_id,
                    occurred_at=clock.now() + timedelta(microseconds=index),
                    created_at=clock.now(),
                    payload=alert.model_dump_json(),
                )
            )
            ids.append(key)
    return ids


def _worker(engine: Engine, clock: ManualClock, receiver: SlackReceiver, **policy: float | int | None) -> Worker:
    destination = Destination(NAME, DestinationKind.SLACK, SecretStr(receiver.webhook_url("T1/B1/worker-secret")))
    return Worker(
        destination=destination,
        engine=engine,
        transport=Transport(timeout_s=5, clock=clock),
        clock=clock,
        policy=DeliveryPolicy(**policy),  # type: ignore[arg-type]
        rng=random.Random(7),
    )


def _states(engine: Engine) -> dict[str, DeliveryState]:
    with Session(engine) as session:
        rows, _count = service.get_all(session, limit=1000)
        return {row.id: row.state for row in rows}


async def test_a_retry_after_is_honoured_across_a_restart(
    engine: Engine, clock: ManualClock, receiver: SlackReceiver
) -> None:
    receiver.script({"answer": "rate_limited", "retry_after": 30})
    [key] = _queue(engine, clock, 1)
    worker = _worker(engine, clock, receiver)
    assert await worker.step() == 0.0  # sent: 429
    assert await worker.step() == pytest.approx(30.0)  # and nothing more is sent before it elapses
    clock.advance(29.5)
    restarted = _worker(engine, clock, receiver)  # the pacing state is in SQL, not in the worker
    assert await restarted.step() == pytest.approx(0.5)
    assert len(receiver.messages()) == 1
    clock.advance(0.5)
    assert await restarted.step() == 0.0
    assert [m.status for m in receiver.messages()] == [429, 200]
    assert _states(engine) == {key: DeliveryState.SENT}


async def test_a_worker_killed_with_its_request_in_flight_leaves_the_pacing_to_the_next(
    engine: Engine, clock: ManualClock, receiver: SlackReceiver
) -> None:
    _queue(engine, clock, 2)
    worker = _worker(engine, clock, receiver, coalesce_max=1)

    async def killed_in_flight(*_args: object) -> None:
        raise asyncio.CancelledError  # the process dies after the request left, before its answer is recorded

    worker.transport.post = killed_in_flight  # type: ignore[method-assign,assignment]
    with pytest.raises(asyncio.CancelledError):
        await worker.step()
    clock.advance(0.4)
    restarted = _worker(engine, clock, receiver, coalesce_max=1)
    assert await restarted.step() == pytest.approx(0.6)  # the interval runs from when the lost request left
    assert receiver.messages() == []
    clock.advance(0.6)
    assert await restarted.step() == 0.0 and len(receiver.messages()) == 1


async def test_alerts_waiting_together_go_out_together_one_message_per_interval(
    engine: Engine, clock: ManualClock, receiver: SlackReceiver
) -> None:
    ids = _queue(engine, clock, 25)
    worker = _worker(engine, clock, receiver, coalesce_max=10)
    sent: list[list[str]] = []
    while len(sent) < 3:
        wait = await worker.step()
        if wait:
            assert wait == pytest.approx(1.0)  # the minimum interval after each message
            clock.advance(wait)
        else:
            sent.append(receiver.messages()[-1].block_ids())
    assert sent == [ids[:10], ids[10:20], ids[20:]]  # oldest first, each alert once
    assert await worker.step() == pytest.approx(1.0) and len(receiver.messages()) == 3


async def test_failures_back_off_exponentially_with_jitter_up_to_the_cap(
    engine: Engine, clock: ManualClock, receiver: SlackReceiver
) -> None:
    receiver.script(*["server_error"] * 6)
    [key] = _queue(engine, clock, 1)
    worker = _worker(engine, clock, receiver, retry_base_s=2.0, retry_max_s=10.0)
    waits = []
    for _attempt in range(6):
        assert await worker.step() == 0.0
        waits.append(await worker.step())
        clock.advance(waits[-1])
    for failures, wait in enumerate(waits, start=1):
        ceiling = max(1.0, min(10.0, 2.0 * 2 ** (failures - 1)))
        assert ceiling / 2 <= wait <= ceiling, (failures, wait)
    assert await worker.step() == 0.0  # the receiver is fine again
    assert _states(engine) == {key: DeliveryState.SENT}
    with Session(engine) as session:
        state = service.get_state(session, name=NAME)
        assert (state.failures, state.wait_reason, state.last_status) == (0, WaitReason.PACING, 200)


async def test_alerts_older_than_the_max_age_are_dead_lettered(
    engine: Engine, clock: ManualClock, receiver: SlackReceiver
) -> None:
    receiver.script("server_error")
    [key] = _queue(engine, clock, 1)
    worker = _worker(engine, clock, receiver, max_age_s=60.0, retry_base_s=1.0)
    assert await worker.step() == 0.0
    clock.advance(61)
    await worker.step()
    assert len(receiver.messages()) == 1
    assert _states(engine) == {key: DeliveryState.DEAD}
    with Session(engine) as session:
        [letter], _count = service.get_dead_letters(session)
    assert (letter.reason, letter.detail) == ("expired", "undelivered after 60 s; last: http 500: internal_error")


@pytest.mark.parametrize(
    ("status", "result"),
    [
        (200, SendResult.SENT),
        (204, SendResult.SENT),
        (301, SendResult.REJECTED),
        (400, SendResult.REJECTED),
        (403, SendResult.REJECTED),
        (404, SendResult.REJECTED),
        (408, SendResult.RETRYABLE),
        (410, SendResult.REJECTED),
        (429, SendResult.RATE_LIMITED),
        (500, SendResult.RETRYABLE),
        (503, SendResult.RETRYABLE),
    ],
)
def test_answers_are_classified(status: int, result: SendResult) -> None:
    answer = classify(status, {"retry-after": "7"}, "no_service", now=datetime(2026, 1, 1, tzinfo=UTC))
    assert answer.result is result
    assert answer.retry_after_s == (7.0 if status == 429 else None)


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("3", 3.0), ("1.5", 1.5), ("-4", 0.0), ("Thu, 01 Jan 2026 00:00:30 GMT", 30.0), ("soon", None), (None, None)],
)
def test_retry_after_header(header: str | None, seconds: float | None) -> None:
    assert parse_retry_after(header, now=datetime(2026, 1, 1, tzinfo=UTC)) == seconds


def test_error_text_is_scrubbed_of_every_form_of_the_url() -> None:
    url = "https://hooks.slack.com/services/T00/B00/abcdefSECRET"
    destination = Destination("ops", DestinationKind.SLACK, SecretStr(url))
    text = f"failed {url} / hooks.slack.com/services/T00/B00/abcdefSECRET / %2Fservices%2FT00%2FB00%2FabcdefSECRET"
    assert "SECRET" not in scrub(text, destination)
    assert scrub(text, destination).count("<ops>") == 3


@pytest.mark.parametrize(("failures", "ceiling"), [(1, 1.0), (2, 2.0), (3, 4.0), (6, 32.0), (7, 60.0), (40, 60.0)])
def test_backoff_table(failures: int, ceiling: float) -> None:
    rng = random.Random(1)
    delays = [backoff_s(failures, base=1.0, cap=60.0, rng=rng) for _ in range(200)]
    assert all(ceiling / 2 <= d <= ceiling for d in delays)
    assert max(delays) - min(delays) > ceiling / 4  # jittered, not fixed
