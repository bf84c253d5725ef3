"""Delivery side effects: one worker per destination sends from the outbox, paced, coalesced and retried.

The pacing state lives in SQL with the outbox, so a restart still honours a Retry-After and the minimum interval.
The next request to a destination is never sent before `next_send_at`, which is moved forward before each request
(its start plus the minimum interval, committed before it leaves, so even a process killed mid-request leaves it) and
again by each answer: to the end of the request plus the minimum interval (so two requests never arrive closer than
that), or further for a 429 (its Retry-After) or a failure (jittered exponential backoff, capped).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.engine import Engine
from sqlmodel import Session

from reprise_common.clock import Clock
from reprise_common.db import session_scope
from reprise_common.logging import get_logger
from reprise_notifier import metrics
from reprise_notifier.alerts import slack, webhook
from reprise_notifier.alerts.models import Alert, Item
from reprise_notifier.deliveries import service
from reprise_notifier.deliveries.models import (
    DeadLetterReason,
    Delivery,
    DestinationState,
    SendResult,
    WaitReason,
)
from reprise_notifier.deliveries.transport import Answer, Transport, scrub
from reprise_notifier.routing import Destination, DestinationKind
from reprise_notifier.settings import NotifierSettings
from reprise_notifier.signing import signature_headers

log = get_logger("reprise.notifier.deliveries")
MESSAGE_ID_HEADER = "X-Reprise-Message-Id"


@dataclass(frozen=True)
class DeliveryPolicy:
    """How much to coalesce, how to back off, when to give up, and how often an idle worker looks."""

    coalesce_max: int = 20
    retry_base_s: float = 1.0
    retry_max_s: float = 300.0
    max_age_s: float | None = None
    idle_poll_s: float = 1.0

    @classmethod
    def from_settings(cls, settings: NotifierSettings) -> DeliveryPolicy:
        """The policy the settings describe."""
        return cls(
            coalesce_max=settings.coalesce_max,
            retry_base_s=settings.retry_base_s,
            retry_max_s=settings.retry_max_s,
            max_age_s=settings.max_age_s,
            idle_poll_s=settings.idle_poll_s,
        )


def backoff_s(failures: int, *, base: float, cap: float, rng: random.Random) -> float:
    """A delay drawn from [c/2, c], c = min(cap, base * 2^(failures-1)): spread out, growing, never above cap."""
    ceiling = min(cap, base * 2 ** max(0, failures - 1))
    return rng.uniform(ceiling / 2, ceiling)


def message_id_of(delivery_ids: list[str]) -> str:
    """The id of the message carrying these deliveries; a retry of the same alerts repeats it."""
    return hashlib.sha256("\n".join(sorted(delivery_ids)).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Plan:
    """What a worker may do now: wait (wait_s > 0), send these items, or nothing (no items)."""

    wait_s: float
    items: list[Item]


class Worker:
    """Sends one destination's outbox, one message at a time."""

    def __init__(
        self,
        *,
        destination: Destination,
        engine: Engine,
        transport: Transport,
        clock: Clock,
        policy: DeliveryPolicy,
        rng: random.Random | None = None,
    ) -> None:
        self.destination = destination
        self.engine = engine
        self.transport = transport
        self.clock = clock
        self.policy = policy
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography
        self.wake = asyncio.Event()

    @property
    def name(self) -> str:
        """The destination's name."""
        return self.destination.name

    async def run(self, stopping: asyncio.Event) -> None:
        """Send until stopping is set; an unexpected error is logged (scrubbed of the URL) and the loop goes on."""
        while not stopping.is_set():
            self.wake.clear()  # alerts queued while we look are seen by this step or wake the pause below
            try:
                delay = await self.step()
            except Exception as exc:  # a database hiccup must not end deliveries for good
                error = scrub(repr(exc), self.destination)
                log.error("delivery step failed; trying again", extra={"destination": self.name, "error": error})
                delay = self.policy.idle_poll_s
            if delay > 0:
                await self._pause(delay, stopping)

    async def step(self) -> float:
        """Send one message if the destination may be sent to and has alerts waiting; seconds until the next look."""
        plan = await asyncio.to_thread(self._plan, self.clock.now())
        if plan.wait_s > 0:
            return plan.wait_s
        if not plan.items:
            return self.policy.idle_poll_s
        message_id = message_id_of([delivery_id for delivery_id, _alert in plan.items])
        body, headers = self.message(plan.items, message_id=message_id, now=self.clock.now())
        answer = await self.transport.post(self.destination, body, headers)
        await asyncio.to_thread(self._record, plan.items, answer, message_id)
        return 0.0

    def message(self, items: list[Item], *, message_id: str, now: datetime) -> tuple[bytes, dict[str, str]]:
        """The body and headers of one request: Block Kit for Slack, signed JSON for a webhook."""
        if self.destination.kind is DestinationKind.SLACK:
            return json.dumps(slack.render(items), ensure_ascii=False).encode(), {}
        body = webhook.encode(webhook.render(items, message_id=message_id, sent_at=now))
        assert self.destination.secret is not None  # routing refuses a webhook without a secret
        secret = self.destination.secret.get_secret_value().encode()
        return body, {**signature_headers(secret, body, timestamp=int(now.timestamp())), MESSAGE_ID_HEADER: message_id}

    async def _pause(self, seconds: float, stopping: asyncio.Event) -> None:
        waits = [asyncio.ensure_future(self.wake.wait()), asyncio.ensure_future(stopping.wait())]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waits:
                waiter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiter

    def _plan(self, now: datetime) -> Plan:
        with session_scope(self.engine) as session:
            if self.policy.max_age_s is not None:
                self._expire(session, now)
            state = service.get_state(session, name=self.name)
            metrics.PENDING.labels(self.name).set(service.count_pending(session).get(self.name, 0))
            if state.next_send_at is not None and state.next_send_at > now:
                return Plan((state.next_send_at - now).total_seconds(), [])
            due = service.get_due(session, destination=self.name, limit=self.policy.coalesce_max)
            if due:
                # The slot is taken before the request leaves: a process killed while it is in flight leaves the
                # pacing in place, where a quick restart would otherwise send again at once.
                state.next_send_at = now + timedelta(seconds=self.destination.min_interval_s)
                state.wait_reason = WaitReason.PACING
            return Plan(0.0, [(d.id, Alert.model_validate_json(d.payload)) for d in due])

    def _expire(self, session: Session, now: datetime) -> None:
        assert self.policy.max_age_s is not None
        expired = service.get_expired(
            session, destination=self.name, created_before=now - timedelta(seconds=self.policy.max_age_s)
        )
        if expired:
            detail = f"undelivered after {self.policy.max_age_s:g} s; last: {expired[0].last_error or 'no attempt'}"
            service.dead_letter(
                session, deliveries=expired, reason=DeadLetterReason.EXPIRED, status=None, detail=detail, now=now
            )
            metrics.DEAD_LETTERS.labels(self.name, DeadLetterReason.EXPIRED.value).inc(len(expired))
            log.warning("alerts expired", extra={"destination": self.name, "count": len(expired)})

    def _record(self, items: list[Item], answer: Answer, message_id: str) -> None:
        done = self.clock.now()
        with session_scope(self.engine) as session:
            deliveries = [d for d in (session.get(Delivery, key) for key, _alert in items) if d is not None]
            state = service.get_state(session, name=self.name)
            state.last_status, state.last_error = answer.status, answer.detail
            wait, reason = self._next_wait(answer, state)
            if answer.result is SendResult.SENT:
                service.mark_sent(deliveries, now=done, status=answer.status, message_id=message_id)
            elif answer.result is SendResult.REJECTED:
                service.dead_letter(
                    session,
                    deliveries=deliveries,
                    reason=DeadLetterReason.REJECTED,
                    status=answer.status,
                    detail=answer.detail,
                    now=done,
                )
            else:
                service.mark_failed(deliveries, now=done, status=answer.status, error=answer.detail)
            state.next_send_at = done + timedelta(seconds=max(wait, self.destination.min_interval_s))
            state.wait_reason = reason if wait > self.destination.min_interval_s else WaitReason.PACING
        self._observe(answer, len(deliveries), wait)

    def _next_wait(self, answer: Answer, state: DestinationState) -> tuple[float, WaitReason]:
        """How long the destination must rest after this answer, and why; updates the failure count."""
        if answer.result is SendResult.RATE_LIMITED and answer.retry_after_s is not None:
            return answer.retry_after_s, WaitReason.RETRY_AFTER
        if answer.result in (SendResult.RETRYABLE, SendResult.RATE_LIMITED):
            state.failures += 1
            delay = backoff_s(state.failures, base=self.policy.retry_base_s, cap=self.policy.retry_max_s, rng=self.rng)
            return delay, WaitReason.BACKOFF
        state.failures = 0
        return 0.0, WaitReason.PACING

    def _observe(self, answer: Answer, count: int, wait: float) -> None:
        metrics.SENDS.labels(self.name, answer.result.value).inc()
        extra = {"destination": self.name, "alerts": count, "status": answer.status, "detail": answer.detail}
        if answer.result is SendResult.SENT:
            metrics.ALERTS_SENT.labels(self.name).inc(count)
            log.info("alerts delivered", extra=extra)
        elif answer.result is SendResult.REJECTED:
            metrics.DEAD_LETTERS.labels(self.name, DeadLetterReason.REJECTED.value).inc(count)
            log.warning("alerts refused for good: dead-lettered", extra=extra)
        else:
            log.warning("delivery failed; will retry", extra={**extra, "retry_in_s": round(wait, 3)})
