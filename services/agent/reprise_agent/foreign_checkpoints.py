"""Checkpoints a script saves itself (the job spec's `checkpoints`): the agent polls their directory at a low rate,
and reports each new one once it is complete and stable, with the SHA-256 of every file computed here, where the
bytes are, as the SDK's save helpers report theirs (`checkpoint.saved`). The registry then commits, hashes and
validates it like any other.

Complete: a file (`file`, `per_rank`) or every file of a directory (`dcp`, `hf`) the same size and mtime at two polls
in a row and again after hashing; a `dcp` directory has its `.metadata` (written last by the coordinator), an `hf`
one its `trainer_state.json` (written after the weights and optimizer). What was there when the watcher started is
not reported unless it changes: it belongs to an earlier launch, which reported it, or to no launch of this job.
Which agent reports: the one running rank 0 (`file`, `dcp`, `hf`, as one rank of a world of one), or each agent its
own ranks' files (`per_rank`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from re import Pattern

from reprise_common.checkpoint_names import CheckpointLayout, PatternError, compile_pattern, read_name
from reprise_common.events import CheckpointSaved, CheckpointWatch, FileDigest, LaunchArgs
from reprise_common.logging import get_logger

log = get_logger("reprise.agent.checkpoints")
MAX_ENTRIES = 10_000  # entries of the directory looked at per poll
MAX_FILES = 4_096  # files of one checkpoint: its report must fit in one message
MAX_DEPTH = 8  # directories below a checkpoint's own
MAX_REPORTS_PER_POLL = 4  # checkpoints hashed per poll, oldest step first
IDLE_POLLS = 3  # polls with no live rank of the job here before the watcher stops (a last save is still reported)
MARKERS = {CheckpointLayout.DCP: ".metadata", CheckpointLayout.HF: "trainer_state.json"}
DIRECTORY_LAYOUTS = frozenset(MARKERS)
Signature = tuple[tuple[str, int, int], ...]  # (path relative to the checkpoint's path, size, mtime_ns) per file


class Skip(StrEnum):
    """Why a checkpoint seen in a poll was not reported (yet)."""

    NO_MARKER = "no_marker"  # still being written
    CHANGING = "changing"  # a file changed since the last poll, or while it was hashed
    TOO_LARGE = "too_large"  # more files than one report carries
    KNOWN = "known"  # reported already, or there before the watcher started


@dataclass(frozen=True)
class Candidate:
    """One checkpoint as a poll saw it."""

    name: str  # its entry in the directory
    step: int
    rank: int
    signature: Signature
    skip: Skip | None = None


@dataclass
class Scope:
    """What this node's agent watches for a job: which of its ranks run here, in which launch."""

    ranks: frozenset[int]
    world_size: int
    restart_epoch: int

    @staticmethod
    def of(spec: LaunchArgs) -> Scope:
        """This node's share of a launch."""
        return Scope(frozenset(r.rank for r in spec.ranks), spec.world_size, spec.restart_epoch)


@dataclass
class CheckpointWatcher:
    """Finds a job's new complete checkpoints in its directory and turns each into a CheckpointSaved."""

    job_id: str
    node_id: str
    watch: CheckpointWatch
    scope: Scope
    pattern: Pattern[str] = field(init=False)
    _last: dict[str, Signature] = field(default_factory=dict, init=False)  # entry -> signature at the last poll
    _known: dict[str, Signature] = field(default_factory=dict, init=False)  # entry -> signature reported (or found)
    _started: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.pattern = compile_pattern(self.watch.pattern, self.watch.layout)

    def poll(self) -> list[CheckpointSaved]:
        """One look at the directory (blocking: run it in a thread): the checkpoints to report now."""
        seen = self.scan()
        if not self._started:  # what is there already is not this launch's to report
            self._started = True
            self._known = {c.name: c.signature for c in seen}
        ready = [c for c in seen if self._judge(c) is None]
        self._last = {c.name: c.signature for c in seen}
        events = []
        for candidate in sorted(ready, key=lambda c: c.step)[:MAX_REPORTS_PER_POLL]:
            event = self._report(candidate)
            if event is not None:
                self._known[candidate.name] = candidate.signature
                events.append(event)
        return events

    def _judge(self, candidate: Candidate) -> Skip | None:
        """Why a candidate is not to be reported now; None when it is."""
        if candidate.skip is not None:
            return candidate.skip
        if self._known.get(candidate.name) == candidate.signature:
            return Skip.KNOWN
        if self._last.get(candidate.name) != candidate.signature:
            return Skip.CHANGING
        return None

    def scan(self) -> list[Candidate]:
        """The entries of the directory the pattern names and this node reports, bounded by MAX_ENTRIES."""
        found: list[Candidate] = []
        try:
            with os.scandir(self.watch.directory) as entries:
                for count, entry in enumerate(entries):
                    if count >= MAX_ENTRIES:
                        log.warning("checkpoint directory too large", extra={"job_id": self.job_id})
                        break
                    candidate = self._candidate(entry)
                    if candidate is not None:
                        found.append(candidate)
        except OSError:  # not created yet, or unreadable for now: the next poll looks again
            return []
        return found

    def _candidate(self, entry: os.DirEntry[str]) -> Candidate | None:
        named = read_name(self.pattern, entry.name)
        if named is None:
            return None
        step, rank = named[0], named[1] if named[1] is not None else 0
        if rank not in self.scope.ranks:
            return None
        if self.watch.layout in DIRECTORY_LAYOUTS:
            if not entry.is_dir(follow_symlinks=False):
                return None
            return self._directory_candidate(entry, step)
        if not entry.is_file(follow_symlinks=False):
            return None
        info = entry.stat(follow_symlinks=False)
        return Candidate(entry.name, step, rank, ((entry.name, info.st_size, info.st_mtime_ns),))

    def _directory_candidate(self, entry: os.DirEntry[str], step: int) -> Candidate:
        files = list_files(entry.path, limit=MAX_FILES + 1)
        skip = None
        if len(files) > MAX_FILES:
            skip = Skip.TOO_LARGE
        elif not any(name == MARKERS[self.watch.layout] for name, _, _ in files):
            skip = Skip.NO_MARKER
        return Candidate(entry.name, step, 0, tuple(sorted(files)), skip)

    def _report(self, candidate: Candidate) -> CheckpointSaved | None:
        """The checkpoint's report, its files hashed; None when a file changed meanwhile (the next poll retries)."""
        base = self._base(candidate)
        try:
            digests = [
                FileDigest(path=name, size_bytes=size, digest=sha256_of(os.path.join(base, name)), algorithm="sha256")
                for name, size, _ in candidate.signature
            ]
            again = [(n, *_size_and_mtime(os.path.join(base, n))) for n, _, _ in candidate.signature]
        except OSError:
            return None
        if tuple(again) != candidate.signature:
            self._last.pop(candidate.name, None)  # changed while hashed: stable at two more polls first
            return None
        per_rank = self.watch.layout is CheckpointLayout.PER_RANK
        return CheckpointSaved(
            source=self.node_id,
            node_id=self.node_id,
            job_id=self.job_id,
            rank=candidate.rank,
            step=candidate.step,
            path=base,
            files=[d.path for d in digests],
            restart_epoch=self.scope.restart_epoch,
            world_size=self.scope.world_size if per_rank else 1,
            file_digests=digests,
            marker=self._marker(candidate),
        )

    def _base(self, candidate: Candidate) -> str:
        """The checkpoint's path as the registry records it: its own directory, or the directory of its file."""
        if self.watch.layout in DIRECTORY_LAYOUTS:
            return os.path.join(self.watch.directory, candidate.name)
        return self.watch.directory

    def _marker(self, candidate: Candidate) -> str | None:
        """The file that proves it complete: the file itself, or the layout's (None: `.metadata`, the default)."""
        if self.watch.layout is CheckpointLayout.DCP:
            return None
        return MARKERS.get(self.watch.layout, candidate.name)


def list_files(top: str, *, limit: int) -> list[tuple[str, int, int]]:
    """(relative path, size, mtime_ns) of the regular files under `top`, symlinks not followed, at most `limit`."""
    files: list[tuple[str, int, int]] = []
    pending = [("", 0)]
    while pending and len(files) < limit:
        relative, depth = pending.pop()
        try:
            with os.scandir(os.path.join(top, relative)) as entries:
                for entry in entries:
                    name = f"{relative}/{entry.name}" if relative else entry.name
                    info = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(info.st_mode):
                        files.append((name, info.st_size, info.st_mtime_ns))
                    elif stat.S_ISDIR(info.st_mode) and depth < MAX_DEPTH:
                        pending.append((name, depth + 1))
                    if len(files) >= limit:
                        break
        except OSError:
            continue
    return files


def sha256_of(path: str) -> str:
    """The SHA-256 of a regular file; a symlink is refused (OSError)."""
    with open(path, "rb", buffering=0, opener=_no_follow) as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def _size_and_mtime(path: str) -> tuple[int, int]:
    info = os.lstat(path)
    return info.st_size, info.st_mtime_ns


Emit = Callable[[CheckpointSaved], None]
Alive = Callable[[str], bool]


class ForeignCheckpoints:
    """The watchers of this node's jobs that save checkpoints of their own: one task per job, polling at its rate."""

    def __init__(self, node_id: str, *, emit: Emit, alive: Alive) -> None:
        self.node_id = node_id
        self.emit = emit
        self.alive = alive
        self._watchers: dict[str, CheckpointWatcher] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def launched(self, job_id: str, spec: LaunchArgs) -> None:
        """A launch of the job here: watch for it (keeping what an earlier launch's watcher saw), or stop watching."""
        watch, scope = spec.checkpoints, Scope.of(spec)
        reports = watch is not None and (watch.layout is CheckpointLayout.PER_RANK or 0 in scope.ranks)
        current = self._watchers.get(job_id)
        if watch is None or not reports:
            self.forget(job_id)
            return
        if current is not None and current.watch == watch:
            current.scope = scope
            return
        self.forget(job_id)
        try:
            self._watchers[job_id] = CheckpointWatcher(job_id, self.node_id, watch, scope)
        except PatternError as exc:  # the orchestrator checked it: only an older or foreign one gets here
            log.warning("checkpoint pattern refused", extra={"job_id": job_id, "error": str(exc)})
            return
        self._tasks[job_id] = asyncio.create_task(self._run(job_id), name=f"checkpoints-{job_id}")

    def forget(self, job_id: str) -> None:
        """Stop watching a job's checkpoints."""
        self._watchers.pop(job_id, None)
        task = self._tasks.pop(job_id, None)
        if task is not None:
            task.cancel()

    def watching(self) -> list[str]:
        """The jobs whose checkpoints are watched here."""
        return list(self._watchers)

    async def close(self) -> None:
        """Stop every watcher."""
        tasks = list(self._tasks.values())
        for job_id in list(self._watchers):
            self.forget(job_id)
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, job_id: str) -> None:
        idle = 0
        while (watcher := self._watchers.get(job_id)) is not None and idle < IDLE_POLLS:
            try:
                events = await asyncio.to_thread(watcher.poll)
            except Exception:  # a bug in one poll must not end the agent's watch for good
                log.exception("checkpoint poll failed", extra={"job_id": job_id})
                events = []
            for event in events:
                log.info("checkpoint found", extra={"job_id": job_id, "step": event.step, "path": event.path})
                self.emit(event)
            idle = 0 if self.alive(job_id) else idle + 1
            await asyncio.sleep(watcher.watch.poll_s)
        if self._watchers.get(job_id) is watcher:
            with contextlib.suppress(KeyError):
                del self._watchers[job_id], self._tasks[job_id]
