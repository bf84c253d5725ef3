"""REST routes for pins and retention."""

from __future__ import annotations

from fastapi import APIRouter, Response

from reprise_registry.checkpoints.views import CheckpointId, unprocessable
from reprise_registry.deps import DepsDep, ReadSession, WriteSession
from reprise_registry.retention import service
from reprise_registry.retention.models import PinCreate, PinPublic, RetentionPolicy, RetentionResult

router = APIRouter(prefix="/v1", tags=["retention"])


@router.post("/checkpoints/{checkpoint_id}/pins", status_code=201, response_model=PinPublic)
def pin_checkpoint(checkpoint_id: CheckpointId, body: PinCreate, session: WriteSession) -> PinPublic:
    """Pin a validated checkpoint while a recovery uses it: retention never deletes it (409 unless validated)."""
    return PinPublic.model_validate(service.pin(session, checkpoint_id=checkpoint_id, data=body), from_attributes=True)


@router.get("/checkpoints/{checkpoint_id}/pins", response_model=list[PinPublic])
def list_pins(checkpoint_id: CheckpointId, session: ReadSession) -> list[PinPublic]:
    """Every pin on a checkpoint."""
    rows = service.pins_of(session, checkpoint_id=checkpoint_id)
    return [PinPublic.model_validate(row, from_attributes=True) for row in rows]


@router.delete("/checkpoints/{checkpoint_id}/pins/{holder}", status_code=204)
def unpin_checkpoint(checkpoint_id: CheckpointId, holder: str, session: WriteSession) -> Response:
    """Release a holder's pin (idempotent)."""
    service.unpin(session, checkpoint_id=checkpoint_id, holder=holder)
    return Response(status_code=204)


@router.post("/jobs/{job_id}/retention", response_model=RetentionResult)
def apply_retention(
    job_id: str, session: WriteSession, deps: DepsDep, body: RetentionPolicy | None = None
) -> RetentionResult:
    """Apply retention to a job now (the configured policy unless one is given); answers what was deleted.

    Files are deleted only where the registry's own setting allows it: a body asking for it otherwise is a 422.
    """
    settings = deps.settings
    if body is not None and body.delete_files and not settings.retention_delete_files:
        message = "this registry does not delete checkpoint files (REPRISE_RETENTION_DELETE_FILES=false)"
        raise unprocessable(("body", "delete_files"), message, True)
    policy = body or RetentionPolicy(
        keep_last=settings.retention_keep_last,
        keep_every=settings.retention_keep_every,
        delete_files=settings.retention_delete_files,
    )
    result = service.apply(session, job_id=job_id, policy=policy, roots=settings.checkpoint_roots)
    if result.deleted:
        deps.wake(deps.announcer_wake)
    return result
