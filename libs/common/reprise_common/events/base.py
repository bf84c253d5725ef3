"""The envelope every message shares: ids, the `Wire` base, the versioned `Event`, dead letters, parse errors.

Each event carries an id (also used as the JetStream ``Nats-Msg-Id`` for dedup), a schema version, a UTC-aware
timestamp and its source. Readers ignore unknown fields so a newer writer does not break an older reader; a
schema version newer than the reader knows is rejected (dead-lettered) rather than misread.
"""

from __future__ import annotations

import os
from collections import deque
from datetime import datetime
from typing import ClassVar, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError, field_validator

from reprise_common.clock import utcnow
from reprise_common.errors import MalformedEventError

SCHEMA_VERSION = 1


_IDS_PER_DRAW = 256
# A random UUID (RFC 9562, version 4) as an integer: version 4 in bits 76-79, variant 0b10 in bits 62-63, the rest
# random.
_UUID_V4 = (4 << 76) | (0x8000 << 48)
_UUID_RANDOM = ((1 << 128) - 1) & ~((0xF << 76) | (0xC000 << 48))
_ids: deque[str] = deque()  # random ids drawn ahead; popleft and extend are atomic, so threads may share it
os.register_at_fork(after_in_child=_ids.clear)  # a forked child must not hand out its parent's next ids


def new_id() -> str:
    """A fresh, collision-free id for events, commands and records: a random (version 4) UUID in hex.

    The randomness is read 256 ids at a time: one system call per id made a storm's database thread give up the
    interpreter lock thousands of times, and wait for it each time behind a busy event loop.
    """
    while True:
        try:
            return _ids.popleft()
        except IndexError:
            raw = os.urandom(16 * _IDS_PER_DRAW)
            _ids.extend(
                f"{int.from_bytes(raw[n : n + 16]) & _UUID_RANDOM | _UUID_V4:032x}" for n in range(0, len(raw), 16)
            )


class Wire(BaseModel):
    """Base of every wire model: tolerant of unknown fields, immutable once built."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class Event(Wire):
    """Envelope fields every event carries."""

    SUPPORTED_VERSION: ClassVar[int] = SCHEMA_VERSION

    event_id: str = Field(default_factory=new_id, min_length=1, max_length=128)
    schema_version: int = SCHEMA_VERSION
    time: AwareDatetime = Field(default_factory=utcnow)
    source: str = Field(min_length=1, max_length=128)

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, value: int) -> int:
        if value < 1 or value > cls.SUPPORTED_VERSION:
            raise ValueError(f"schema_version {value} not supported (this reader knows 1..{cls.SUPPORTED_VERSION})")
        return value

    def to_bytes(self) -> bytes:
        """Serialise to compact JSON."""
        return self.model_dump_json().encode()


class DeadLetter(Event):
    """A message a consumer could not use, kept with the reason; nothing is dropped silently."""

    type: Literal["dead.letter"] = "dead.letter"
    original_subject: str
    reason: str
    payload: str = Field(description="the raw payload, decoded as UTF-8 with replacement, at most 64 KiB")
    delivered: int = 1


def malformed(exc: ValidationError, what: str) -> MalformedEventError:
    """A one-line MalformedEventError for the first problem pydantic found in a message."""
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return MalformedEventError(f"not JSON: {first['msg']}")
    where = ".".join(str(p) for p in first["loc"]) or "(root)"
    return MalformedEventError(f"invalid {what} at {where}: {first['msg']}")


def event_timestamp(event: Event) -> datetime:
    """The event's own timestamp (always UTC-aware)."""
    return event.time
