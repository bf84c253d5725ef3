"""Re-checks of validated checkpoints: right before a restore, after a failed load, and periodically.

A checkpoint validated an hour ago may have lost a file or had a byte flipped since. A restore re-checks the newest
candidate's presence and sizes (stat only: milliseconds) and hands its manifest to the ranks, which check the digests
of what they load; a candidate that fails is marked corrupt and the next older one is tried. A reported load failure
and the periodic sweep re-hash every file, so a corrupt checkpoint is found before anyone asks for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from sqlmodel import Session, col, select

from reprise_common.clock import utcnow
from reprise_common.errors import NotFoundError
from reprise_registry.checkpoints import service
from reprise_registry.checkpoints.models import Checkpoint, CheckpointFile, CheckpointState, SkippedCheckpoint
from reprise_registry.db import Engines
from reprise_registry.validation.service import validate_checkpoint

RESTORE_CANDIDATES = 8  # a restore gives up after this many corrupt checkpoints in a row (the job starts over)
PRESENCE_ONLY = 0.0  # sample fraction of a restore's re-check: marker, ranks and sizes, no digest
EVERY_FILE = 1.0


@dataclass
class RestorePick:
    """What a restore should use, and what it passed over."""

    checkpoint: Checkpoint | None = None
    files: Sequence[CheckpointFile] = ()
    digests_checked: bool = False
    skipped: list[SkippedCheckpoint] = field(default_factory=list)


def pick_restore_point(
    engines: Engines,
    *,
    job_id: str,
    carry_files: int,
    roots: Sequence[Path],
    workers: int | None = None,
    before_step: int | None = None,
) -> RestorePick:
    """The newest validated checkpoint (older than before_step when given) that still passes its re-check; corrupt
    ones on the way are marked so.

    A manifest of at most `carry_files` files goes to the ranks, which check the digests of what they load; a larger
    one is re-hashed here in full before it is handed out.
    """
    pick = RestorePick()
    for _ in range(RESTORE_CANDIDATES):
        with Session(engines.read) as session:
            try:
                candidate = service.latest_validated(session, job_id=job_id, before_step=before_step)
            except NotFoundError:
                return pick
        assert candidate.id is not None
        full = (candidate.file_count or 0) > carry_files
        fraction = EVERY_FILE if full else PRESENCE_ONLY
        checked = validate_checkpoint(
            engines, checkpoint_id=candidate.id, sample_fraction=fraction, workers=workers, roots=roots
        )
        if checked.state == CheckpointState.VALIDATED:
            pick.checkpoint, pick.digests_checked = checked, full
            if not full:
                with Session(engines.read) as session:
                    pick.files = service.files_of(session, checkpoint_id=candidate.id)
            return pick
        pick.skipped.append(SkippedCheckpoint(id=candidate.id, step=candidate.step, reason=checked.reason[:300]))
    return pick


@dataclass(frozen=True)
class Reverify:
    """How the periodic sweep re-verifies validated checkpoints."""

    interval_s: float  # a checkpoint is re-verified once it was last verified this long ago
    per_job: int  # the newest N validated checkpoints of each job: the ones a restore would pick
    sample_fraction: float
    limit: int = 20  # checkpoints per pass, the longest unverified first


def reverify_due(engines: Engines, *, plan: Reverify, roots: Sequence[Path], workers: int | None = None) -> int:
    """Re-verify the recent validated checkpoints whose last verification is older than the interval; how many."""
    cutoff = utcnow() - timedelta(seconds=plan.interval_s)
    with Session(engines.read) as session:
        query = select(Checkpoint.id, Checkpoint.job_id, Checkpoint.validated_at).where(
            Checkpoint.state == CheckpointState.VALIDATED, col(Checkpoint.load_failed_at).is_(None)
        )
        rows = session.exec(query.order_by(col(Checkpoint.job_id), col(Checkpoint.step).desc())).all()
    seen: dict[str, int] = {}
    due = []
    for checkpoint_id, job_id, validated_at in rows:
        seen[job_id] = seen.get(job_id, 0) + 1
        if seen[job_id] <= plan.per_job and checkpoint_id is not None and (validated_at or cutoff) <= cutoff:
            due.append((validated_at or cutoff, checkpoint_id))
    for _, checkpoint_id in sorted(due)[: plan.limit]:
        validate_checkpoint(
            engines, checkpoint_id=checkpoint_id, sample_fraction=plan.sample_fraction, workers=workers, roots=roots
        )
    return min(len(due), plan.limit)


def sweep(
    engines: Engines,
    *,
    requested: set[int],
    plan: Reverify,
    roots: Sequence[Path],
    workers: int | None = None,
) -> int:
    """Re-hash every file of each checkpoint whose load failed (`requested`, drained), then the periodic sweep."""
    done = 0
    while requested:
        validate_checkpoint(
            engines, checkpoint_id=requested.pop(), sample_fraction=EVERY_FILE, workers=workers, roots=roots
        )
        done += 1
    return done + reverify_due(engines, plan=plan, roots=roots, workers=workers)
