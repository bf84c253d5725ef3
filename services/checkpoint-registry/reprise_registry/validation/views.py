"""REST routes for validation: validate a checkpoint now, and pick the checkpoint a job restores from (re-checked)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query

from reprise_common.db import SQL_INT_MAX
from reprise_common.errors import ConflictError
from reprise_common.events import RESUME_FILES_MAX
from reprise_registry.checkpoints.models import (
    CheckpointFilePublic,
    CheckpointPublic,
    CheckpointState,
    RestorePointPublic,
)
from reprise_registry.checkpoints.views import CheckpointId
from reprise_registry.deps import DepsDep
from reprise_registry.validation.recheck import pick_restore_point
from reprise_registry.validation.service import validate_checkpoint

router = APIRouter(prefix="/v1", tags=["checkpoints"])


def _public(row: object) -> CheckpointPublic:
    return CheckpointPublic.model_validate(row, from_attributes=True)


@router.post("/checkpoints/{checkpoint_id}/validate", response_model=CheckpointPublic)
async def validate_now(
    checkpoint_id: CheckpointId, deps: DepsDep, sample_fraction: Annotated[float | None, Query(ge=0, le=1)] = None
) -> CheckpointPublic:
    """Validate a committed checkpoint now, or re-verify a validated one; answers with the outcome."""
    fraction = deps.settings.validate_sample_fraction if sample_fraction is None else sample_fraction
    checkpoint = await asyncio.to_thread(
        validate_checkpoint,
        deps.engines,
        checkpoint_id=checkpoint_id,
        sample_fraction=fraction,
        workers=deps.settings.hash_workers,
        roots=deps.settings.checkpoint_roots,
    )
    if checkpoint.state not in (CheckpointState.VALIDATED, CheckpointState.CORRUPT):
        raise ConflictError(f"checkpoint {checkpoint_id} is {checkpoint.state}: only a committed one is validated")
    deps.announcer_wake.set()
    return _public(checkpoint)


@router.post("/jobs/{job_id}/restore-point", response_model=RestorePointPublic)
async def restore_point(
    job_id: str,
    deps: DepsDep,
    carry_files: Annotated[
        int, Query(ge=0, le=RESUME_FILES_MAX, description="the most files the caller hands to the ranks to check")
    ] = RESUME_FILES_MAX,
    before_step: Annotated[
        int | None, Query(ge=0, le=SQL_INT_MAX, description="only checkpoints older than this step (a numeric fault's)")
    ] = None,
) -> RestorePointPublic:
    """The newest validated checkpoint re-checked now (marker, ranks, file sizes; every digest when its manifest has
    more than carry_files files), with its manifest; checkpoints that fail are marked corrupt and skipped."""
    pick = await asyncio.to_thread(
        pick_restore_point,
        deps.engines,
        job_id=job_id,
        carry_files=carry_files,
        before_step=before_step,
        roots=deps.settings.checkpoint_roots,
        workers=deps.settings.hash_workers,
    )
    if pick.skipped:
        deps.announcer_wake.set()
    return RestorePointPublic(
        checkpoint=_public(pick.checkpoint) if pick.checkpoint is not None else None,
        files=[CheckpointFilePublic.model_validate(f, from_attributes=True) for f in pick.files],
        digests_checked=pick.digests_checked,
        skipped=pick.skipped,
    )
