"""Validating checkpoints: read the manifest, run the checks, record validated or corrupt (with an event)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Sequence
from pathlib import Path

from sqlalchemy import func, update
from sqlalchemy import select as sql_select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from reprise_common.clock import utcnow
from reprise_common.events import CheckpointChange
from reprise_common.logging import get_logger
from reprise_registry.checkpoints import announce, service
from reprise_registry.checkpoints.models import Algorithm, Checkpoint, CheckpointFile, CheckpointState
from reprise_registry.db import Engines
from reprise_registry.validation.checks import ManifestFile, Verdict, validate

log = get_logger("reprise.registry.validation")
VALIDATABLE = (CheckpointState.COMMITTED, CheckpointState.VALIDATED)
_ALGORITHMS = {algorithm.value: algorithm for algorithm in Algorithm}  # a dict lookup is 10x an Enum() call


def load_manifest(session: Session, *, checkpoint_id: int) -> list[ManifestFile]:
    """The manifest as plain tuples (no ORM objects: a 16,384-file manifest loads in milliseconds)."""
    f = CheckpointFile
    query = sql_select(col(f.path), col(f.rank), col(f.size_bytes), col(f.digest), col(f.algorithm)).where(
        col(f.checkpoint_id) == checkpoint_id
    )
    return [
        ManifestFile(path=p, rank=r, size_bytes=s, digest=d, algorithm=_ALGORITHMS[a])
        for p, r, s, d, a in session.execute(query).all()
    ]


def validate_checkpoint(
    engines: Engines,
    *,
    checkpoint_id: int,
    sample_fraction: float,
    workers: int | None = None,
    seed: int | None = None,
    roots: Sequence[Path],
) -> Checkpoint:
    """Validate one committed (or re-check one validated) checkpoint and record the outcome; blocking.

    Files are read only inside the checkpoint's directory within `roots` (default: the configured roots).
    """
    with Session(engines.read) as session:
        checkpoint = service.get(session, checkpoint_id=checkpoint_id)
        if checkpoint.state not in VALIDATABLE:
            return checkpoint
        ranks = service.ranks_of(session, checkpoint_id=checkpoint_id)
        files = load_manifest(session, checkpoint_id=checkpoint_id)
        session.expunge(checkpoint)
    verdict = validate(
        checkpoint,
        ranks=ranks,
        files=files,
        sample_fraction=sample_fraction,
        workers=workers,
        rng=random.Random(seed),  # noqa: S311 - sampling, not secrecy
        roots=roots,
    )
    return record_verdict(engines.write, checkpoint_id=checkpoint_id, expected=checkpoint.state, verdict=verdict)


def record_verdict(engine: Engine, *, checkpoint_id: int, expected: CheckpointState, verdict: Verdict) -> Checkpoint:
    """Store the outcome unless the checkpoint changed state meanwhile; queue its event in the same transaction."""
    with Session(engine) as session:
        checkpoint = service.get(session, checkpoint_id=checkpoint_id)
        if checkpoint.state != expected:
            return checkpoint  # someone else decided first (another validator, retention)
        for path, digest in verdict.computed.items():
            session.execute(
                update(CheckpointFile)
                .where(col(CheckpointFile.checkpoint_id) == checkpoint_id, col(CheckpointFile.path) == path)
                .values(digest=digest)
            )
        if verdict.computed:
            entries = service.manifest_entries(session, checkpoint_id=checkpoint_id)
            checkpoint.manifest_digest = service.manifest_digest(entries)
        if verdict.ok:
            _to_validated(session, checkpoint)
        else:
            checkpoint.state = CheckpointState.CORRUPT
            checkpoint.reason = verdict.reason[:1024]
            log.warning(
                "checkpoint is corrupt",
                extra={"checkpoint_id": checkpoint_id, "job_id": checkpoint.job_id, "reason": verdict.reason},
            )
        session.add(checkpoint)
        if checkpoint.state != expected:
            announce_change(session, checkpoint)
        session.commit()
        session.refresh(checkpoint)
        return checkpoint


def _to_validated(session: Session, checkpoint: Checkpoint) -> None:
    checkpoint.validated_at = utcnow()
    if checkpoint.state == CheckpointState.VALIDATED:
        return  # a re-check that passed
    highest = session.exec(
        select(func.max(Checkpoint.validated_seq)).where(Checkpoint.job_id == checkpoint.job_id)
    ).one()
    checkpoint.validated_seq = (highest or 0) + 1
    checkpoint.state = CheckpointState.VALIDATED
    checkpoint.reason = ""


def announce_change(session: Session, checkpoint: Checkpoint) -> None:
    """Queue the event for a checkpoint's new state (validated, corrupt or deleted) in the open transaction."""
    assert checkpoint.id is not None
    event = CheckpointChange(
        source="checkpoint-registry",
        change=checkpoint.state.value,
        checkpoint_id=checkpoint.id,
        job_id=checkpoint.job_id,
        step=checkpoint.step,
        path=checkpoint.path,
        manifest_digest=checkpoint.manifest_digest,
        reason=checkpoint.reason,
    )
    announce.record(session, event, checkpoint_id=checkpoint.id)


def validate_pending(
    engines: Engines,
    *,
    sample_fraction: float,
    workers: int | None = None,
    limit: int = 50,
    roots: Sequence[Path],
) -> int:
    """Validate every committed checkpoint (oldest first); returns how many were decided."""
    with Session(engines.read) as session:
        pending = service.get_all_by_state(session, state=CheckpointState.COMMITTED, limit=limit)
    for checkpoint_id in pending:
        validate_checkpoint(
            engines, checkpoint_id=checkpoint_id, sample_fraction=sample_fraction, workers=workers, roots=roots
        )
    return len(pending)


async def run_validator(
    engines: Engines,
    *,
    wake: asyncio.Event,
    announced: asyncio.Event,
    sample_fraction: float,
    workers: int | None,
    interval_s: float,
    roots: Sequence[Path],
    sweep: Callable[[], int] = lambda: 0,
) -> None:
    """Validate committed checkpoints whenever woken and every interval (level-triggered: survives restarts).

    `sweep` runs after each pass that found nothing to validate (the re-verifications); it returns how many it did.
    """
    while True:
        wake.clear()
        try:
            decided = await asyncio.to_thread(
                validate_pending, engines, sample_fraction=sample_fraction, workers=workers, roots=roots
            )
            decided = decided or await asyncio.to_thread(sweep)
        except Exception:  # a database hiccup must not stop validation for good; the next pass retries
            log.exception("validation pass failed")
            decided = 0
        if decided:
            announced.set()
            continue
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout=interval_s)
