"""Registration over NATS: agents' checkpoint.saved events, and job placements for the expected world size."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from sqlmodel import Session

from reprise_common import subjects
from reprise_common.bus import Delivery, Outcome
from reprise_common.errors import ConflictError, MalformedEventError
from reprise_common.events import CheckpointSaved, Event, JobPlacement
from reprise_common.logging import get_logger
from reprise_registry.checkpoints import paths, service
from reprise_registry.checkpoints.models import (
    DEFAULT_MARKER,
    Algorithm,
    CheckpointCreate,
    CheckpointState,
    FileReport,
    Layout,
)
from reprise_registry.db import Engines

log = get_logger("reprise.registry.flows")


class MissingFileError(Exception):
    """A reported file is not on storage (yet): the event is retried, then dead-lettered."""


def layout_of(files: list[str]) -> Layout:
    """DCP when the rank wrote .distcp shards or the .metadata file; per-rank files otherwise."""
    names = [Path(f).name for f in files]
    return Layout.DCP if any(n.endswith(".distcp") or n == ".metadata" for n in names) else Layout.PER_RANK


def confine(event: CheckpointSaved, roots: Sequence[Path]) -> Path:
    """The event's checkpoint directory, resolved, once it and every file it names are inside the roots."""
    directory = paths.checkpoint_directory(event.path, roots)
    for index, path in enumerate(event.files):
        paths.reported_file(event.path, directory, path, field=("files", index))
    for index, digest in enumerate(event.file_digests):
        paths.reported_file(event.path, directory, digest.path, field=("file_digests", index, "path"))
    return directory


def file_reports(event: CheckpointSaved, directory: Path) -> list[FileReport]:
    """The event's files with the writer's sizes and digests; a file without one is measured here (size only).

    `directory` is the event's, as confine() resolved it: nothing outside it is stat-ed.
    """
    digests = {d.path: d for d in event.file_digests}
    reports: list[FileReport] = []
    for path in dict.fromkeys([*event.files, *digests]):
        known = digests.get(path)
        if known is not None:
            algorithm = Algorithm(known.algorithm)
            reports.append(FileReport(path=path, size_bytes=known.size_bytes, digest=known.digest, algorithm=algorithm))
            continue
        relative = paths.reported_file(event.path, directory, path, field=("files",))
        absolute = os.path.join(directory, relative)
        try:
            size = os.stat(absolute).st_size
        except FileNotFoundError as exc:
            raise MissingFileError(f"{absolute} reported by rank {event.rank} is not on storage") from exc
        reports.append(FileReport(path=path, size_bytes=size))
    return reports


def register_saved(engines: Engines, event: CheckpointSaved, *, roots: Sequence[Path]) -> bool:
    """Begin (idempotently), record the rank's files, and commit when complete; True when it is committed now.

    An event whose directory is outside the roots, or naming a file outside that directory, raises PathRefusedError
    before anything is stat-ed or stored.
    """
    layout = layout_of(event.files)
    reports = file_reports(event, confine(event, roots))
    with Session(engines.write) as session:
        checkpoint = service.begin(
            session,
            data=CheckpointCreate(
                job_id=event.job_id,
                step=event.step,
                path=event.path,
                world_size=event.world_size,
                layout=layout,
                marker=event.marker or DEFAULT_MARKER[layout],  # a script's own checkpoint names its own
                restart_epoch=event.restart_epoch,
            ),
            roots=roots,
        )
        assert checkpoint.id is not None
        service.report_rank(session, checkpoint_id=checkpoint.id, rank=event.rank, files=reports, roots=roots)
        return service.try_commit(session, checkpoint_id=checkpoint.id, roots=roots).committed


class Registration:
    """The registry's NATS handlers."""

    def __init__(self, engines: Engines, *, on_committed: Callable[[], None], roots: Sequence[Path]) -> None:
        self.engines = engines
        self.on_committed = on_committed
        self.roots = roots

    async def on_checkpoint_saved(self, event: Event, delivery: Delivery) -> Outcome:
        """Handler of the agents' checkpoint.saved events."""
        if not isinstance(event, CheckpointSaved):
            raise MalformedEventError(f"a {event.model_dump().get('type')} event on the checkpoint.saved subject")
        node_id = subjects.node_from_agent_subject(delivery.subject)  # identity from the subject, not the payload
        try:
            committed = await asyncio.to_thread(register_saved, self.engines, event, roots=self.roots)
        except MissingFileError as exc:
            log.warning("reported checkpoint file not found", extra={"node_id": node_id, "error": str(exc)})
            return Outcome.RETRY
        except (ConflictError, paths.PathRefusedError, ValueError) as exc:  # retrying cannot make it acceptable
            raise MalformedEventError(f"checkpoint report refused: {exc}") from exc
        if committed:
            log.info("checkpoint committed", extra={"job_id": event.job_id, "step": event.step, "node_id": node_id})
            self.on_committed()
        return Outcome.ACK

    async def on_placement(self, event: Event, delivery: Delivery) -> Outcome:
        """Handler of job placements: remember each job's world size."""
        if not isinstance(event, JobPlacement):
            raise MalformedEventError(f"a {event.model_dump().get('type')} event on the placements stream")
        if event.active and event.world_size > 0:
            await asyncio.to_thread(self._record_placement, event)
        return Outcome.ACK

    def _record_placement(self, event: JobPlacement) -> None:
        """Remember the world size, then commit the job's checkpoints that only waited for it."""
        with Session(self.engines.write) as session:
            service.record_placement(
                session, job_id=event.job_id, restart_epoch=event.restart_epoch, world_size=event.world_size
            )
            waiting = service.get_all_by_job(session, job_id=event.job_id, state=CheckpointState.WRITING, limit=10)
            ids = [c.id for c in waiting if c.world_size is None and c.id is not None]
            committed = [service.try_commit(session, checkpoint_id=i, roots=self.roots).committed for i in ids]
        if any(committed):
            self.on_committed()
