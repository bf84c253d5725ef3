"""REST routes for checkpoints: begin, report a rank's files, commit, look up, report a load failure (validating one
and picking one to restore are validation's routes)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

from fastapi import APIRouter, Path, Query
from fastapi.exceptions import RequestValidationError

from reprise_common.db import SQL_INT_MAX
from reprise_common.errors import ConflictError
from reprise_registry.checkpoints import service
from reprise_registry.checkpoints.models import (
    CheckpointCreate,
    CheckpointFilePublic,
    CheckpointFilesPublic,
    CheckpointPublic,
    CheckpointsPublic,
    CheckpointState,
    CommitResult,
    LoadFailure,
    RankReport,
)
from reprise_registry.checkpoints.paths import FieldPath, PathRefusedError
from reprise_registry.deps import DepsDep, ReadSession, WriteSession

# Path parameters, bounded so that a number past 64 bits is a 422 naming it, not an overflow in the database (500).
CheckpointId = Annotated[int, Path(ge=1, le=SQL_INT_MAX, description="a checkpoint's id")]
RankNumber = Annotated[int, Path(ge=0, le=1_000_000, description="a rank of the checkpoint's world")]
router = APIRouter(prefix="/v1", tags=["checkpoints"])


def _public(row: object) -> CheckpointPublic:
    return CheckpointPublic.model_validate(row, from_attributes=True)


def unprocessable(loc: FieldPath, message: str, value: object) -> RequestValidationError:
    """A 422 shaped like FastAPI's own validation errors, for what only the service can judge."""
    return RequestValidationError([{"type": "value_error", "loc": loc, "msg": message, "input": value}])


@contextmanager
def _refused_as_422() -> Iterator[None]:
    """A path refused by the confinement checks is the request's fault: 422 naming the body field."""
    try:
        yield
    except PathRefusedError as exc:
        raise unprocessable(("body", *exc.field), exc.reason, exc.value) from exc


@router.post("/checkpoints", status_code=201, response_model=CheckpointPublic)
def begin_checkpoint(body: CheckpointCreate, session: WriteSession, deps: DepsDep) -> CheckpointPublic:
    """Begin recording a checkpoint (idempotent per job and step); it is restorable only once validated.

    Its path must resolve to a directory inside the registry's checkpoint roots, its marker inside that (422).
    """
    with _refused_as_422():
        return _public(service.begin(session, data=body, roots=deps.settings.checkpoint_roots))


@router.get("/checkpoints/{checkpoint_id}", response_model=CheckpointPublic)
def get_checkpoint(checkpoint_id: CheckpointId, session: ReadSession) -> CheckpointPublic:
    """One checkpoint."""
    return _public(service.get(session, checkpoint_id=checkpoint_id))


@router.get("/checkpoints/{checkpoint_id}/files", response_model=CheckpointFilesPublic)
def list_files(checkpoint_id: CheckpointId, session: ReadSession) -> CheckpointFilesPublic:
    """A checkpoint's manifest: every file with its rank, size and digest."""
    service.get(session, checkpoint_id=checkpoint_id)
    rows = service.files_of(session, checkpoint_id=checkpoint_id)
    data = [CheckpointFilePublic.model_validate(row, from_attributes=True) for row in rows]
    return CheckpointFilesPublic(data=data, count=len(data))


@router.put("/checkpoints/{checkpoint_id}/ranks/{rank}", response_model=CheckpointPublic)
def report_rank(
    checkpoint_id: CheckpointId, rank: RankNumber, body: RankReport, session: WriteSession, deps: DepsDep
) -> CheckpointPublic:
    """Record the files one rank wrote, with their sizes and digests (repeating a report is harmless).

    Each file must resolve inside the checkpoint's directory, symlinks followed (422 naming the file otherwise).
    """
    if rank < 0:
        raise ConflictError("rank must be ≥ 0")
    roots = deps.settings.checkpoint_roots
    with _refused_as_422():
        checkpoint = service.report_rank(session, checkpoint_id=checkpoint_id, rank=rank, files=body.files, roots=roots)
    return _public(checkpoint)


@router.post("/checkpoints/{checkpoint_id}/commit", response_model=CommitResult)
def commit_checkpoint(checkpoint_id: CheckpointId, session: WriteSession, deps: DepsDep) -> CommitResult:
    """Commit once every rank reported and the marker exists (409 says what is missing); validation follows."""
    result = service.try_commit(session, checkpoint_id=checkpoint_id, roots=deps.settings.checkpoint_roots)
    if not result.committed:
        raise ConflictError(f"checkpoint {checkpoint_id} cannot be committed yet: {result.detail}")
    deps.wake(deps.validator_wake)
    return result


@router.post("/checkpoints/{checkpoint_id}/load-failed", response_model=CheckpointPublic)
def load_failed(
    checkpoint_id: CheckpointId, body: LoadFailure, session: WriteSession, deps: DepsDep
) -> CheckpointPublic:
    """Report that restoring this checkpoint failed: latest-validated falls back to the previous one, and every file
    of it is re-hashed soon (corrupt when one differs)."""
    checkpoint = service.mark_load_failed(session, checkpoint_id=checkpoint_id, reason=body.reason)
    if checkpoint.state == CheckpointState.VALIDATED:
        deps.rechecks.add(checkpoint_id)
        deps.wake(deps.validator_wake)
    return _public(checkpoint)


@router.get("/jobs/{job_id}/checkpoints", response_model=CheckpointsPublic)
def list_checkpoints(
    job_id: str,
    session: ReadSession,
    state: CheckpointState | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> CheckpointsPublic:
    """A job's checkpoints, newest first, optionally in one state."""
    rows = service.get_all_by_job(session, job_id=job_id, state=state, limit=limit)
    data = [_public(row) for row in rows]
    return CheckpointsPublic(data=data, count=len(data))


@router.get("/jobs/{job_id}/checkpoints/latest", response_model=CheckpointPublic)
def latest_checkpoint(
    job_id: str, session: ReadSession, before_step: Annotated[int | None, Query(ge=0, le=SQL_INT_MAX)] = None
) -> CheckpointPublic:
    """The newest validated checkpoint that has not failed to load (404 when none); before_step asks for older."""
    return _public(service.latest_validated(session, job_id=job_id, before_step=before_step))
