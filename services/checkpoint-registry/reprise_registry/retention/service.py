"""Retention: keep the newest K validated checkpoints plus every Nth; never delete a pinned one.

Deciding and pinning lock the checkpoint rows (FOR UPDATE on PostgreSQL; BEGIN IMMEDIATE serialises SQLite), so a
pin taken by a recovery and a retention pass cannot cross: either the pin lands first and the checkpoint is kept,
or the checkpoint is already deleted and the pin is refused.

Files are removed only inside the checkpoint's directory, itself inside the roots, checked again at deletion time: a
row stored before paths were confined, or a symlink swapped in since, is skipped and reported, never followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import or_
from sqlmodel import Session, col, delete, select

from reprise_common.clock import utcnow
from reprise_common.errors import ConflictError, NotFoundError
from reprise_common.logging import get_logger
from reprise_registry.checkpoints import paths
from reprise_registry.checkpoints import service as checkpoints
from reprise_registry.checkpoints.models import Checkpoint, CheckpointState
from reprise_registry.retention.models import CheckpointPin, PinCreate, RetentionPolicy, RetentionResult
from reprise_registry.validation import service as validation

if TYPE_CHECKING:
    from reprise_registry.deps import Deps

log = get_logger("reprise.registry.retention")


# --- pins -----------------------------------------------------------------------------------------------------
def pin(session: Session, *, checkpoint_id: int, data: PinCreate, now: datetime | None = None) -> CheckpointPin:
    """Pin a validated checkpoint for a holder (idempotent: pinning again renews the expiry)."""
    now = now or utcnow()
    checkpoint = session.exec(select(Checkpoint).where(Checkpoint.id == checkpoint_id).with_for_update()).first()
    if checkpoint is None:
        raise NotFoundError(f"checkpoint {checkpoint_id} not found")
    if checkpoint.state != CheckpointState.VALIDATED:
        raise ConflictError(f"checkpoint {checkpoint_id} is {checkpoint.state}: only a validated one can be pinned")
    expires = now + timedelta(seconds=data.ttl_s) if data.ttl_s is not None else None
    query = select(CheckpointPin).where(
        CheckpointPin.checkpoint_id == checkpoint_id, CheckpointPin.holder == data.holder
    )
    row = session.exec(query).first()
    if row is None:
        row = CheckpointPin(checkpoint_id=checkpoint_id, holder=data.holder, created_at=now, expires_at=expires)
    else:
        row.expires_at = expires
    session.add(row)
    session.commit()
    session.refresh(row)
    return row


def unpin(session: Session, *, checkpoint_id: int, holder: str) -> None:
    """Release a holder's pin (releasing one that is not there is fine)."""
    session.execute(
        delete(CheckpointPin).where(
            col(CheckpointPin.checkpoint_id) == checkpoint_id, col(CheckpointPin.holder) == holder
        )
    )
    session.commit()


def pins_of(session: Session, *, checkpoint_id: int) -> Sequence[CheckpointPin]:
    """Every pin on a checkpoint, expired ones included."""
    return session.exec(select(CheckpointPin).where(CheckpointPin.checkpoint_id == checkpoint_id)).all()


def _pinned(session: Session, ids: list[int], now: datetime) -> set[int]:
    if not ids:
        return set()
    query = select(CheckpointPin.checkpoint_id).where(
        col(CheckpointPin.checkpoint_id).in_(ids),
        or_(col(CheckpointPin.expires_at).is_(None), col(CheckpointPin.expires_at) > now),
    )
    return set(session.exec(query).all())


# --- the policy -----------------------------------------------------------------------------------------------
def to_keep(rows: Sequence[Checkpoint], policy: RetentionPolicy) -> set[int]:
    """Ids kept by the policy: the newest keep_last restorable ones, plus every keep_every-th ever validated."""
    newest_first = sorted(rows, key=lambda r: r.step, reverse=True)
    restorable = [r for r in newest_first if r.load_failed_at is None]
    keep = {r.id for r in restorable[: policy.keep_last] if r.id is not None}
    if policy.keep_every:
        keep |= {r.id for r in rows if r.id is not None and (r.validated_seq or 0) % policy.keep_every == 0}
    return keep


def apply(
    session: Session,
    *,
    job_id: str,
    policy: RetentionPolicy,
    roots: Sequence[Path],
    now: datetime | None = None,
) -> RetentionResult:
    """Mark the validated checkpoints the policy does not keep as deleted (files removed after, if asked)."""
    now = now or utcnow()
    query = select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.state == CheckpointState.VALIDATED)
    rows = session.exec(query.with_for_update()).all()
    keep = to_keep(rows, policy)
    candidates = [r for r in rows if r.id not in keep]
    pinned = _pinned(session, [r.id for r in candidates if r.id is not None], now)
    doomed = [r for r in candidates if r.id not in pinned]
    for row in doomed:
        row.state = CheckpointState.DELETED
        row.reason = f"retention: not among the newest {policy.keep_last}" + (
            f" nor every {policy.keep_every}th" if policy.keep_every else ""
        )
        session.add(row)
        validation.announce_change(session, row)
    session.commit()
    result = RetentionResult(
        job_id=job_id,
        kept=sorted(r.id for r in rows if r.id in keep and r.id is not None),
        deleted=sorted(r.id for r in doomed if r.id is not None),
        pinned=sorted(pinned),
        files_deleted=0,
    )
    if policy.delete_files:
        for row in doomed:
            assert row.id is not None
            files = [f.path for f in checkpoints.files_of(session, checkpoint_id=row.id)]
            count, errors = delete_files(row, files, roots=roots)
            result.files_deleted += count
            result.errors.extend(errors)
    return result


def delete_files(
    checkpoint: Checkpoint, relative_paths: Sequence[str], *, roots: Sequence[Path]
) -> tuple[int, list[str]]:
    """Remove a deleted checkpoint's files, then its marker, then its directory if nothing else is left.

    Only inside the checkpoint's directory within `roots` (default: the configured roots); anything else is skipped
    and reported in the errors.
    """
    try:
        root = paths.checkpoint_directory(checkpoint.path, roots)
    except paths.PathRefusedError as exc:
        return 0, [f"checkpoint {checkpoint.id}: nothing deleted, {exc}"]
    count, errors = 0, []
    for relative in [*relative_paths, checkpoint.marker]:
        try:
            paths.removable(root, relative, field=("path",)).unlink()
            count += 1
        except paths.PathRefusedError as exc:
            errors.append(f"checkpoint {checkpoint.id}: {relative} not deleted, {exc.reason}")
        except FileNotFoundError:
            continue
        except OSError as exc:
            errors.append(f"{root / relative}: {exc}")
    with contextlib.suppress(OSError):  # not empty (other files, another checkpoint) or gone: leave it
        os.rmdir(root)
    return count, errors


def jobs_with_validated(session: Session) -> list[str]:
    """Jobs that have at least one validated checkpoint."""
    query = select(Checkpoint.job_id).where(Checkpoint.state == CheckpointState.VALIDATED).distinct()
    return list(session.exec(query).all())


def apply_all(deps: Deps) -> list[RetentionResult]:
    """One retention pass over every job with the configured policy."""
    settings = deps.settings
    policy = RetentionPolicy(
        keep_last=settings.retention_keep_last,
        keep_every=settings.retention_keep_every,
        delete_files=settings.retention_delete_files,
    )
    with Session(deps.engines.read) as session:
        jobs = jobs_with_validated(session)
    results = []
    for job_id in jobs:
        with Session(deps.engines.write) as session:
            results.append(apply(session, job_id=job_id, policy=policy, roots=settings.checkpoint_roots))
    return results


async def run_retention(deps: Deps) -> None:
    """Apply retention every interval."""
    while True:
        await asyncio.sleep(deps.settings.retention_interval_s)
        try:
            results = await asyncio.to_thread(apply_all, deps)
        except Exception:  # a failed pass is retried at the next interval
            log.exception("retention pass failed")
            continue
        if any(r.deleted for r in results):
            deps.wake(deps.announcer_wake)
