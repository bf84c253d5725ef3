"""Cordon records: a cordoned node gets no new ranks until someone uncordons it."""

from __future__ import annotations

from datetime import datetime

from sqlmodel import Field, SQLModel

from reprise_common.db import UTCDateTime


class CordonBase(SQLModel):
    """Why a node is (or was) cordoned."""

    reason: str = Field(default="", max_length=2000)


class CordonRequest(CordonBase):
    """Body of POST /v1/nodes/{node_id}/cordon."""


class NodeCordon(CordonBase, table=True):
    """One row per node that was ever cordoned; `cordoned` says whether it still is."""

    node_id: str = Field(primary_key=True, max_length=64)
    cordoned: bool = Field(default=True, index=True)
    by: str = Field(default="", max_length=200, description="recovery:<id>, quarantine, or api:<key>")
    job_id: str | None = Field(default=None, max_length=64)
    cordoned_at: datetime = Field(sa_type=UTCDateTime, index=True)
    uncordoned_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class CordonPublic(CordonBase):
    """A node's cordon as the API shows it."""

    node_id: str
    cordoned: bool
    by: str = ""
    job_id: str | None = None
    cordoned_at: datetime | None = None
    uncordoned_at: datetime | None = None
