"""API key and audit records, and their API shapes."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, Column
from sqlmodel import Field, SQLModel

from reprise_common.auth import ANONYMOUS, Scope
from reprise_common.clock import utcnow
from reprise_common.db import UTCDateTime


class ApiKeyBase(SQLModel):
    """Fields an admin provides."""

    name: str = Field(min_length=1, max_length=200)


class ApiKeyCreate(ApiKeyBase):
    """Body of POST /v1/api-keys; the highest scope listed decides (admin implies operate implies read)."""

    scopes: list[Scope] = Field(min_length=1)


class ApiKey(ApiKeyBase, table=True):
    """An API key row: only the SHA-256 of the key is kept, never the key."""

    id: str = Field(primary_key=True, max_length=64)
    hash: str = Field(max_length=64, description="hex SHA-256 of the whole key")
    scopes: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    revoked_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    last_used_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class ApiKeyPublic(ApiKeyBase):
    """A key as the API lists it: never its secret or hash."""

    id: str
    scopes: list[Scope]
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None


class ApiKeyCreated(ApiKeyPublic):
    """The answer to a creation: the only time the key itself is shown."""

    key: str


class ApiKeysPublic(SQLModel):
    """Every key, newest first."""

    data: list[ApiKeyPublic]
    count: int


class AuditRecord(SQLModel, table=True):
    """One mutating call, allowed or refused: who, what, the answer; never a body, header or key."""

    id: int | None = Field(default=None, primary_key=True)
    at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime, index=True)
    key_id: str | None = Field(default=None, index=True)
    actor: str = Field(default=ANONYMOUS, index=True, description="the key's name, or anonymous")
    method: str
    path: str
    job_id: str | None = Field(default=None, index=True)
    status: int
    client: str | None = None


class AuditRecordPublic(SQLModel):
    """An audit record as the API shows it."""

    id: int
    at: datetime
    key_id: str | None
    actor: str
    method: str
    path: str
    job_id: str | None
    status: int
    client: str | None


class AuditRecordsPublic(SQLModel):
    """Audit records, newest first."""

    data: list[AuditRecordPublic]
    count: int
