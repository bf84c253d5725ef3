"""REST routes for API keys and the audit trail (app.py requires the admin scope for all of them)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from reprise_common.service import IsoDateTime
from reprise_orchestrator.auth import service
from reprise_orchestrator.auth.models import (
    ApiKeyCreate,
    ApiKeyCreated,
    ApiKeyPublic,
    ApiKeysPublic,
    AuditRecordPublic,
    AuditRecordsPublic,
)
from reprise_orchestrator.deps import DepsDep, SessionDep

router = APIRouter(prefix="/v1", tags=["auth"])


@router.post("/api-keys", status_code=201, response_model=ApiKeyCreated)
def create_api_key(body: ApiKeyCreate, session: SessionDep, deps: DepsDep) -> ApiKeyCreated:
    """Create a key with scopes; the answer holds the key itself, shown this once and never again."""
    row, key = service.create(session, name=body.name, scopes=body.scopes, now=deps.clock.now())
    return ApiKeyCreated.model_validate({**row.model_dump(exclude={"hash"}), "key": key})


@router.get("/api-keys", response_model=ApiKeysPublic)
def list_api_keys(session: SessionDep) -> ApiKeysPublic:
    """Every key, revoked ones included, newest first: never a secret or a hash."""
    data = [ApiKeyPublic.model_validate(row, from_attributes=True) for row in service.get_all(session)]
    return ApiKeysPublic(data=data, count=len(data))


@router.delete("/api-keys/{key_id}", response_model=ApiKeyPublic)
def revoke_api_key(key_id: str, session: SessionDep, deps: DepsDep) -> ApiKeyPublic:
    """Revoke a key: it is refused (401) from now on; repeating is harmless; 404 if unknown."""
    row = service.revoke(session, key_id=key_id, now=deps.clock.now())
    return ApiKeyPublic.model_validate(row, from_attributes=True)


@router.get("/audit", response_model=AuditRecordsPublic)
def list_audit(
    session: SessionDep,
    actor: Annotated[str | None, Query(description="a key's name or id, or anonymous")] = None,
    job_id: str | None = None,
    since: Annotated[IsoDateTime | None, Query(description="at or after (ISO 8601 with a zone)")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> AuditRecordsPublic:
    """Mutating calls, allowed and refused, newest first, filtered by actor, job and time."""
    rows = service.get_audit(session, actor=actor, job_id=job_id, since=since, limit=limit)
    data = [AuditRecordPublic.model_validate(row, from_attributes=True) for row in rows]
    return AuditRecordsPublic(data=data, count=len(data))
