"""The outbox (one delivery per alert and destination), dead letters, and each destination's pacing state."""

from __future__ import annotations

import hashlib
from datetime import datetime
from enum import StrEnum

from sqlalchemy import Index, String, Text
from sqlmodel import Field, SQLModel

from reprise_common.db import UTCDateTime


class DeliveryState(StrEnum):
    """Where one alert for one destination is."""

    PENDING = "pending"  # in the outbox: sent by the destination's worker when its pacing allows
    SENT = "sent"  # the destination answered 2xx
    DEAD = "dead"  # refused for good (or too old): see its dead letter


class SendResult(StrEnum):
    """How a destination answered one request."""

    SENT = "sent"
    RATE_LIMITED = "rate_limited"  # 429: wait its Retry-After
    RETRYABLE = "retryable"  # 5xx, timeout, connection error: back off and try again
    REJECTED = "rejected"  # a permanent 4xx: retrying cannot help


class DeadLetterReason(StrEnum):
    """Why an alert was given up on."""

    REJECTED = "rejected"  # the destination refused it for good (400, 403, 404, 410, ...)
    EXPIRED = "expired"  # still undelivered after REPRISE_MAX_AGE_S


class WaitReason(StrEnum):
    """Why a destination's worker may not send before next_send_at."""

    PACING = "pacing"  # at most one message per min interval
    RETRY_AFTER = "retry_after"  # the destination said 429 with a Retry-After
    BACKOFF = "backoff"  # the last attempt failed (5xx, timeout): jittered exponential backoff


def delivery_id(event_id: str, destination: str) -> str:
    """The stable id of an event's alert for one destination: a redelivered event maps to the same delivery."""
    return hashlib.sha256(f"{event_id}\x00{destination}".encode()).hexdigest()[:32]


# --- deliveries (the outbox) -----------------------------------------------------------------------------------
class DeliveryBase(SQLModel):
    """One alert for one destination and how its delivery went."""

    event_id: str = Field(max_length=128)
    destination: str = Field(max_length=64)
    kind: str = Field(max_length=32)
    job_id: str = Field(max_length=64, index=True)
    incident_id: str | None = Field(default=None, max_length=128)
    state: DeliveryState = Field(default=DeliveryState.PENDING, sa_type=String(16))
    attempts: int = 0
    occurred_at: datetime = Field(sa_type=UTCDateTime, description="when the event happened")
    created_at: datetime = Field(sa_type=UTCDateTime, description="when the alert entered the outbox")
    last_attempt_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    sent_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    last_status: int | None = Field(default=None, description="the HTTP status of the last attempt")
    last_error: str = Field(default="", sa_type=Text, description="why the last attempt failed (no URL, ever)")
    message_id: str | None = Field(default=None, max_length=32, description="the message it went out in")


class Delivery(DeliveryBase, table=True):
    """A delivery row; `payload` is the alert as JSON, rendered for the destination only when sent."""

    __tablename__ = "notifier_delivery"
    __table_args__ = (Index("ix_notifier_delivery_due", "destination", "state", "created_at"),)

    id: str = Field(primary_key=True, max_length=32)
    payload: str = Field(sa_type=Text)


class DeliveryPublic(DeliveryBase):
    """A delivery as the API returns it."""

    id: str


class DeliveriesPublic(SQLModel):
    """A page of deliveries and how many match in all."""

    data: list[DeliveryPublic]
    count: int


# --- dead letters ----------------------------------------------------------------------------------------------
class DeadLetterBase(SQLModel):
    """An alert given up on, with the reason."""

    destination: str = Field(max_length=64, index=True)
    event_id: str = Field(max_length=128)
    kind: str = Field(max_length=32)
    job_id: str = Field(max_length=64)
    reason: DeadLetterReason = Field(sa_type=String(16))
    status: int | None = Field(default=None, description="the HTTP status that refused it, if any")
    detail: str = Field(default="", sa_type=Text)
    dead_at: datetime = Field(sa_type=UTCDateTime)


class DeadLetter(DeadLetterBase, table=True):
    """A dead-letter row; its id is the delivery's."""

    __tablename__ = "notifier_dead_letter"

    id: str = Field(primary_key=True, max_length=32)


class DeadLetterPublic(DeadLetterBase):
    """A dead letter as the API returns it."""

    id: str


class DeadLettersPublic(SQLModel):
    """A page of dead letters and how many there are in all."""

    data: list[DeadLetterPublic]
    count: int


# --- destinations ----------------------------------------------------------------------------------------------
class DestinationState(SQLModel, table=True):
    """When a destination may next be sent to, and why; kept in SQL so a restart keeps honouring it."""

    __tablename__ = "notifier_destination"

    name: str = Field(primary_key=True, max_length=64)
    next_send_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    wait_reason: WaitReason | None = Field(default=None, sa_type=String(16))
    failures: int = Field(default=0, description="consecutive retryable failures (the backoff exponent)")
    last_status: int | None = None
    last_error: str = Field(default="", sa_type=Text)


class DestinationPublic(SQLModel):
    """A destination by name (never its URL), its kind, its backlog and when it may next be sent to."""

    name: str
    kind: str
    pending: int
    next_send_at: datetime | None
    wait_reason: WaitReason | None
    failures: int
    last_status: int | None
    last_error: str


class DestinationsPublic(SQLModel):
    """Every configured destination."""

    data: list[DestinationPublic]
    count: int
