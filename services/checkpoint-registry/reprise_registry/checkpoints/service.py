"""Data access for checkpoints: keyword-only functions, one per question or change.

Functions that change rows expect a session on the write engine (BEGIN IMMEDIATE on SQLite) and commit themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import blake3
from sqlalchemy import delete, func
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from reprise_common.clock import utcnow
from reprise_common.db import insert_rows
from reprise_common.errors import ConflictError, NotFoundError
from reprise_registry.checkpoints import paths
from reprise_registry.checkpoints.models import (
    DEFAULT_MARKER,
    Checkpoint,
    CheckpointCreate,
    CheckpointFile,
    CheckpointPublic,
    CheckpointRank,
    CheckpointState,
    CommitResult,
    FileReport,
    JobWorldSize,
)

RESTARTABLE = (CheckpointState.WRITING, CheckpointState.CORRUPT, CheckpointState.DELETED)
DONE_WRITING = (CheckpointState.COMMITTED, CheckpointState.VALIDATED)


# --- questions ------------------------------------------------------------------------------------------------
def get(session: Session, *, checkpoint_id: int) -> Checkpoint:
    """One checkpoint, or NotFoundError."""
    checkpoint = session.get(Checkpoint, checkpoint_id)
    if checkpoint is None:
        raise NotFoundError(f"checkpoint {checkpoint_id} not found")
    return checkpoint


def get_by_step(session: Session, *, job_id: str, step: int) -> Checkpoint | None:
    """A job's checkpoint of one step, if any."""
    return session.exec(select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step)).first()


def get_all_by_job(
    session: Session, *, job_id: str, state: CheckpointState | None = None, limit: int = 100
) -> Sequence[Checkpoint]:
    """A job's checkpoints, newest step first, optionally in one state."""
    query = select(Checkpoint).where(Checkpoint.job_id == job_id)
    if state is not None:
        query = query.where(Checkpoint.state == state)
    return session.exec(query.order_by(col(Checkpoint.step).desc()).limit(limit)).all()


def get_all_by_state(session: Session, *, state: CheckpointState, limit: int = 100) -> Sequence[int]:
    """Ids of checkpoints in a state, oldest first (the validator's work list)."""
    query = select(Checkpoint.id).where(Checkpoint.state == state).order_by(col(Checkpoint.id)).limit(limit)
    return [row for row in session.exec(query).all() if row is not None]


def files_of(session: Session, *, checkpoint_id: int) -> Sequence[CheckpointFile]:
    """A checkpoint's manifest, by rank then path."""
    query = select(CheckpointFile).where(CheckpointFile.checkpoint_id == checkpoint_id)
    return session.exec(query.order_by(col(CheckpointFile.rank), col(CheckpointFile.path))).all()


def ranks_of(session: Session, *, checkpoint_id: int) -> set[int]:
    """The ranks that have reported their part."""
    query = select(CheckpointRank.rank).where(CheckpointRank.checkpoint_id == checkpoint_id)
    return set(session.exec(query).all())


def latest_validated(session: Session, *, job_id: str, before_step: int | None = None) -> Checkpoint:
    """The newest validated checkpoint that has not failed to load (older than before_step when given)."""
    query = select(Checkpoint).where(
        Checkpoint.job_id == job_id,
        Checkpoint.state == CheckpointState.VALIDATED,
        col(Checkpoint.load_failed_at).is_(None),
    )
    if before_step is not None:
        query = query.where(Checkpoint.step < before_step)
    found = session.exec(query.order_by(col(Checkpoint.step).desc()).limit(1)).first()
    if found is None:
        raise NotFoundError(f"no validated checkpoint for job {job_id}")
    return found


def world_size_of(session: Session, *, job_id: str) -> int | None:
    """The world size of the job's latest placement seen on the bus, if any."""
    row = session.get(JobWorldSize, job_id)
    return row.world_size if row is not None else None


# --- changes --------------------------------------------------------------------------------------------------
def begin(session: Session, *, data: CheckpointCreate, roots: Sequence[Path]) -> Checkpoint:
    """Begin a checkpoint, or return the one already begun for the same job and step (idempotent).

    A corrupt, deleted or never-finished checkpoint of the same step is started over when the new attempt comes from
    a later restart epoch (the job was restored and wrote that step again); anything else that differs conflicts.
    Its directory must lie inside one of `roots` (default: the configured ones) and its marker inside it
    (PathRefusedError otherwise).
    """
    directory = paths.checkpoint_directory(data.path, roots)
    paths.marker_file(directory, data.marker or DEFAULT_MARKER[data.layout])
    for attempt in range(2):
        try:
            return _begin_once(session, data)
        except IntegrityError:  # a concurrent begin of the same step won the insert (PostgreSQL): read it
            session.rollback()
            if attempt:
                raise
    raise AssertionError("unreachable")


def _begin_once(session: Session, data: CheckpointCreate) -> Checkpoint:
    marker = data.marker or DEFAULT_MARKER[data.layout]
    existing = get_by_step(session, job_id=data.job_id, step=data.step)
    if existing is None:
        checkpoint = Checkpoint(**data.model_dump(exclude={"marker"}), marker=marker)
        session.add(checkpoint)
        session.commit()
        session.refresh(checkpoint)
        return checkpoint
    same = existing.path == data.path and existing.layout == data.layout
    if same and existing.state in DONE_WRITING:
        return existing
    if same and existing.state == CheckpointState.WRITING and data.restart_epoch <= existing.restart_epoch:
        if data.world_size is not None and existing.world_size is None:
            existing.world_size = data.world_size
            session.add(existing)
            session.commit()
        elif data.world_size not in (None, existing.world_size):
            raise ConflictError(f"checkpoint {existing.id} was begun with world size {existing.world_size}")
        return existing
    if existing.state in RESTARTABLE and data.restart_epoch > existing.restart_epoch:
        return _start_over(session, existing, data, marker)
    raise ConflictError(
        f"job {data.job_id} already has a {existing.state} checkpoint of step {data.step} at {existing.path} "
        f"(restart epoch {existing.restart_epoch}); a new attempt needs a higher restart_epoch"
    )


def _start_over(session: Session, existing: Checkpoint, data: CheckpointCreate, marker: str) -> Checkpoint:
    assert existing.id is not None
    session.execute(delete(CheckpointFile).where(col(CheckpointFile.checkpoint_id) == existing.id))
    session.execute(delete(CheckpointRank).where(col(CheckpointRank.checkpoint_id) == existing.id))
    fresh = Checkpoint(**data.model_dump(exclude={"marker"}), marker=marker)
    for name, value in fresh.model_dump(exclude={"id"}).items():
        setattr(existing, name, value)
    session.add(existing)
    session.commit()
    session.refresh(existing)
    return existing


def directory_of(checkpoint: Checkpoint, roots: Sequence[Path]) -> Path:
    """A stored checkpoint's resolved directory; ConflictError when it is (now) outside the roots."""
    try:
        return paths.checkpoint_directory(checkpoint.path, roots)
    except paths.PathRefusedError as exc:
        raise ConflictError(f"checkpoint {checkpoint.id} is refused: {exc}") from exc


def report_rank(
    session: Session, *, checkpoint_id: int, rank: int, files: Sequence[FileReport], roots: Sequence[Path]
) -> Checkpoint:
    """Record the files one rank wrote (replacing an earlier report of that rank while still writing).

    Each file must stay inside the checkpoint's directory, symlinks followed (PathRefusedError naming it otherwise).
    """
    checkpoint = get(session, checkpoint_id=checkpoint_id)
    if checkpoint.world_size is not None and rank >= checkpoint.world_size:
        raise ConflictError(f"rank {rank} is outside world size {checkpoint.world_size}")
    directory = directory_of(checkpoint, roots)
    rows = [
        {
            "checkpoint_id": checkpoint_id,
            "rank": rank,
            "path": paths.reported_file(checkpoint.path, directory, f.path, field=("files", index, "path")),
            "size_bytes": f.size_bytes,
            "digest": f.digest,
            "algorithm": f.algorithm.value,
            "reported_at": utcnow(),
        }
        for index, f in enumerate(files)
    ]
    if checkpoint.state != CheckpointState.WRITING:
        if _same_report(session, checkpoint_id, rank, rows):
            return checkpoint  # a repeated report (redelivery) of what was committed
        raise ConflictError(f"checkpoint {checkpoint_id} is {checkpoint.state}: its files can no longer change")
    session.execute(
        delete(CheckpointFile).where(
            col(CheckpointFile.checkpoint_id) == checkpoint_id, col(CheckpointFile.rank) == rank
        )
    )
    if rows:
        try:
            insert_rows(session.connection(), CheckpointFile, rows)
        except IntegrityError as exc:
            session.rollback()
            raise ConflictError(f"a file of rank {rank} was already reported by another rank: {exc.orig}") from exc
    if rank not in ranks_of(session, checkpoint_id=checkpoint_id):
        session.add(CheckpointRank(checkpoint_id=checkpoint_id, rank=rank))
    session.commit()
    session.refresh(checkpoint)
    return checkpoint


def _same_report(session: Session, checkpoint_id: int, rank: int, rows: Sequence[Mapping[str, object]]) -> bool:
    known = {(f.path, f.size_bytes, f.digest) for f in files_of(session, checkpoint_id=checkpoint_id) if f.rank == rank}
    return known == {(r["path"], r["size_bytes"], r["digest"]) for r in rows}


def try_commit(session: Session, *, checkpoint_id: int, roots: Sequence[Path]) -> CommitResult:
    """Commit when every rank of the world has reported for this step and the commit marker exists on storage."""
    checkpoint = get(session, checkpoint_id=checkpoint_id)
    if checkpoint.state != CheckpointState.WRITING:
        return _commit_result(checkpoint, committed=checkpoint.state in DONE_WRITING, marker=True, missing=[])
    world_size = checkpoint.world_size or world_size_of(session, job_id=checkpoint.job_id)
    if world_size is None:
        detail = "world size unknown: begin with world_size, or wait for the job's placement"
        return _commit_result(checkpoint, committed=False, marker=False, missing=[], detail=detail)
    missing = sorted(set(range(world_size)) - ranks_of(session, checkpoint_id=checkpoint_id))
    try:
        marker = paths.marker_present(paths.checkpoint_directory(checkpoint.path, roots), checkpoint.marker)
    except paths.PathRefusedError as exc:  # a row stored before paths were confined: never committed
        return _commit_result(checkpoint, committed=False, marker=False, missing=missing, detail=f"refused: {exc}")
    if missing or not marker:
        detail = f"missing ranks {missing[:20]}" if missing else f"commit marker {checkpoint.marker} not found"
        return _commit_result(checkpoint, committed=False, marker=marker, missing=missing, detail=detail)
    summary = session.execute(
        select(func.count(), func.coalesce(func.sum(CheckpointFile.size_bytes), 0)).where(
            CheckpointFile.checkpoint_id == checkpoint_id
        )
    ).one()
    checkpoint.world_size = world_size
    checkpoint.file_count, checkpoint.size_bytes = int(summary[0]), int(summary[1])
    checkpoint.manifest_digest = manifest_digest(manifest_entries(session, checkpoint_id=checkpoint_id))
    checkpoint.state = CheckpointState.COMMITTED
    checkpoint.committed_at = utcnow()
    session.add(checkpoint)
    session.commit()
    session.refresh(checkpoint)
    return _commit_result(checkpoint, committed=True, marker=True, missing=[])


def manifest_entries(session: Session, *, checkpoint_id: int) -> list[tuple[str, int, str | None, str]]:
    """(path, size, digest, algorithm) of every file, the input of the manifest digest."""
    query = select(CheckpointFile.path, CheckpointFile.size_bytes, CheckpointFile.digest, CheckpointFile.algorithm)
    rows = session.execute(query.where(CheckpointFile.checkpoint_id == checkpoint_id)).all()
    return [(str(p), int(s), d, str(a)) for p, s, d, a in rows]


def manifest_digest(entries: Iterable[tuple[str, int, str | None, str]]) -> str:
    """One BLAKE3 digest over a manifest's (path, size, digest, algorithm) lines, in path order."""
    hasher = blake3.blake3()
    for path, size, digest, algorithm in sorted(entries):
        hasher.update(f"{path}\t{size}\t{algorithm}:{digest or '-'}\n".encode())
    return str(hasher.hexdigest())


def _commit_result(
    checkpoint: Checkpoint, *, committed: bool, marker: bool, missing: list[int], detail: str = ""
) -> CommitResult:
    return CommitResult(
        committed=committed,
        missing_ranks=missing,
        marker_present=marker,
        detail=detail,
        checkpoint=CheckpointPublic.model_validate(checkpoint, from_attributes=True),
    )


def mark_load_failed(session: Session, *, checkpoint_id: int, reason: str) -> Checkpoint:
    """Record that a restore could not load it: latest-validated skips it from now on."""
    checkpoint = get(session, checkpoint_id=checkpoint_id)
    if checkpoint.load_failed_at is None:
        checkpoint.load_failed_at = utcnow()
        checkpoint.load_failure = reason[:1024]
        session.add(checkpoint)
        session.commit()
        session.refresh(checkpoint)
    return checkpoint


def record_placement(session: Session, *, job_id: str, restart_epoch: int, world_size: int) -> None:
    """Remember a job's world size from its newest placement (older epochs are ignored)."""
    row = session.get(JobWorldSize, job_id)
    if row is None:
        session.add(JobWorldSize(job_id=job_id, restart_epoch=restart_epoch, world_size=world_size))
    elif restart_epoch >= row.restart_epoch:
        row.restart_epoch, row.world_size = restart_epoch, world_size
        session.add(row)
    session.commit()
