"""Many ranks reporting and committing at once on SQLite never surface "database is locked" to a caller."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sqlmodel import Session, func, select

from reprise_registry import db
from reprise_registry.checkpoints import service
from reprise_registry.checkpoints.models import CheckpointCreate, CheckpointFile, CheckpointRank, FileReport

WORLD = 48
STEPS = 6

WORKER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from sqlmodel import Session
    from reprise_registry import db
    from reprise_registry.checkpoints import service
    from reprise_registry.checkpoints.models import CheckpointCreate, FileReport

    url, root, first, count = sys.argv[1], Path(sys.argv[2]).resolve(), int(sys.argv[3]), int(sys.argv[4])
    engine = db.make_write_engine(url)
    for rank in range(first, first + count):
        for step in range(100, 100 + {steps}):
            with Session(engine) as session:
                data = CheckpointCreate(job_id="proc", step=step, path=str(root / str(step)), world_size={world})
                checkpoint = service.begin(session, data=data, roots=[root])
                files = [FileReport(path=f"rank-{{rank:05d}}.pt", size_bytes=rank)]
                service.report_rank(session, checkpoint_id=checkpoint.id, rank=rank, files=files, roots=[root])
                service.try_commit(session, checkpoint_id=checkpoint.id, roots=[root])
    """
).format(steps=STEPS, world=WORLD)


def _report(url: str, root: Path, rank: int) -> None:
    engine = ENGINES[url]
    for step in range(STEPS):
        with Session(engine) as session:
            data = CheckpointCreate(job_id="threads", step=step, path=str(root / str(step)), world_size=WORLD)
            checkpoint = service.begin(session, data=data, roots=[root.resolve()])
            assert checkpoint.id is not None
            files = [FileReport(path=f"rank-{rank:05d}.pt", size_bytes=rank)]
            service.report_rank(session, checkpoint_id=checkpoint.id, rank=rank, files=files, roots=[root.resolve()])
            service.try_commit(session, checkpoint_id=checkpoint.id, roots=[root.resolve()])


ENGINES: dict[str, object] = {}


def _counts(url: str, job_id: str) -> tuple[int, int]:
    engine = db.make_write_engine(url)
    with Session(engine) as session:
        ids = [c.id for c in service.get_all_by_job(session, job_id=job_id)]
        files = session.exec(select(func.count()).where(CheckpointFile.checkpoint_id.in_(ids))).one()  # type: ignore[attr-defined]
        ranks = session.exec(select(func.count()).where(CheckpointRank.checkpoint_id.in_(ids))).one()  # type: ignore[attr-defined]
    engine.dispose()
    return int(files), int(ranks)


def test_threads_and_processes_writing_at_once(sqlite_url: str, tmp_path: Path) -> None:
    engine = db.make_write_engine(sqlite_url)
    db.upgrade(engine)
    ENGINES[sqlite_url] = engine
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, sqlite_url, str(tmp_path), str(first), str(WORLD // 4)],
            stderr=subprocess.PIPE,
            text=True,
        )
        for first in range(0, WORLD, WORLD // 4)
    ]
    with ThreadPoolExecutor(max_workers=WORLD) as pool:
        errors = [f.exception() for f in [pool.submit(_report, sqlite_url, tmp_path, rank) for rank in range(WORLD)]]
    outcomes = [(p.wait(timeout=120), p.stderr.read() if p.stderr else "") for p in procs]
    engine.dispose()
    assert [e for e in errors if e is not None] == []
    assert all(code == 0 for code, _ in outcomes), [err[-2000:] for code, err in outcomes if code]
    assert _counts(sqlite_url, "threads") == (WORLD * STEPS, WORLD * STEPS)
    assert _counts(sqlite_url, "proc") == (WORLD * STEPS, WORLD * STEPS)
