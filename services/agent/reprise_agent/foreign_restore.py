"""Restoring a checkpoint the script saved itself: the agent re-hashes the restored files before it starts a rank
(the script does not check digests, as the SDK's load helpers do), and tells the script which checkpoint to load
through what it already reads: `restore_args` appended to its command, `restore_env` in its environment.

Every node's agent checks every file (any rank may read any of them: a snapshot every rank loads, DCP shards read by
plan). A file that differs from the registry's manifest (missing, another size or digest, a symlink) starts no rank:
the launch is answered `failed` with the reason under RESTORE_REFUSED, the recovery reports the load failure (the
registry re-hashes the checkpoint, marks it corrupt, and skips it), and its next attempt restores the checkpoint
before it.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from reprise_common.checkpoint_names import CheckpointLayout, compile_pattern, read_name
from reprise_common.errors import RepriseError
from reprise_common.events import CheckpointWatch, LaunchArgs, ResumeFile
from reprise_common.logging import get_logger

log = get_logger("reprise.agent.restore")
DIRECTORY_LAYOUTS = frozenset({CheckpointLayout.DCP, CheckpointLayout.HF})


class Mismatch(StrEnum):
    """Why a restored file is refused before launch."""

    MISSING = "missing"
    NOT_A_FILE = "not_a_file"
    SIZE = "size"
    DIGEST = "digest"
    UNREADABLE = "unreadable"


class RestoreRefusedError(RepriseError):
    """A restored file differs from what the registry validated: no rank may start on it."""

    def __init__(self, checkpoint: str, problem: str) -> None:
        super().__init__(f"the restored checkpoint {checkpoint} was refused before launch: {problem}")
        self.problem = problem


@dataclass(frozen=True)
class Target:
    """What the script is told to load: a path and the step it holds."""

    path: str
    step: int | None


def restores_own_checkpoint(spec: LaunchArgs) -> bool:
    """The launch restores a checkpoint the script saved itself (the job spec's `checkpoints`)."""
    return spec.checkpoints is not None and bool(spec.resume_checkpoint)


def prepared(spec: LaunchArgs) -> LaunchArgs:
    """The launch as the ranks get it (blocking: run it in a thread): the restored checkpoint verified and handed to
    the script; RestoreRefusedError when a file differs."""
    watch = spec.checkpoints
    if watch is None or not spec.resume_checkpoint:
        return spec
    if watch.verify_before_launch:
        problem = verify(spec.resume_checkpoint, spec.resume_files)
        if problem is not None:
            log.warning("restored checkpoint differs", extra={"checkpoint": spec.resume_checkpoint, "why": problem})
            raise RestoreRefusedError(spec.resume_checkpoint, problem)
    target = target_of(watch, spec.resume_checkpoint, spec.resume_files)
    return handed(spec, watch, target)


def verify(directory: str, files: list[ResumeFile]) -> str | None:
    """The first file that differs from the manifest, said in a sentence; None when every one matches."""
    for file in files:
        path = os.path.join(directory, file.path)
        found = _mismatch(path, file)
        if found is not None:
            kind, detail = found
            return f"{kind.value}: {file.path} {detail}"
    return None


def _mismatch(path: str, file: ResumeFile) -> tuple[Mismatch, str] | None:
    found = _stat_mismatch(path, file)
    if found is not None:
        return found
    try:
        digest = _digest(path, file.algorithm)
    except OSError as exc:
        return Mismatch.UNREADABLE, f"cannot be read ({exc.strerror})"
    if digest is not None and digest != file.digest:
        return Mismatch.DIGEST, f"has {file.algorithm} {digest[:16]}…, the registry validated {file.digest[:16]}…"
    return None


def _stat_mismatch(path: str, file: ResumeFile) -> tuple[Mismatch, str] | None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return Mismatch.MISSING, "is missing"
    except OSError as exc:
        return Mismatch.UNREADABLE, f"cannot be read ({exc.strerror})"
    if not stat.S_ISREG(info.st_mode):
        return Mismatch.NOT_A_FILE, "is not a regular file"
    if info.st_size != file.size_bytes:
        return Mismatch.SIZE, f"has {info.st_size} bytes, the registry validated {file.size_bytes}"
    return None


def _digest(path: str, algorithm: str) -> str | None:
    """The file's digest; None for BLAKE3 without the blake3 package (its size was checked)."""
    hasher: Any
    if algorithm == "sha256":
        hasher = hashlib.sha256()
    else:
        try:
            import blake3  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415 - optional
        except ImportError:
            log.warning("blake3 is not installed: only sizes are checked", extra={"path": path})
            return None
        hasher = blake3.blake3()
    with open(path, "rb", buffering=0, opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as stream:
        while chunk := stream.read(1 << 20):
            hasher.update(chunk)
    return str(hasher.hexdigest())


def target_of(watch: CheckpointWatch, checkpoint: str, files: list[ResumeFile]) -> Target:
    """The path the script loads (the file, or the checkpoint's directory; for per-rank files their directory) and
    its step, read from the name as the pattern says."""
    pattern = compile_pattern(watch.pattern, watch.layout)
    if watch.layout in DIRECTORY_LAYOUTS:
        named = read_name(pattern, os.path.basename(checkpoint.rstrip("/")))
        return Target(checkpoint, named[0] if named else None)
    for file in files:
        named = read_name(pattern, file.path)
        if named is not None:
            path = checkpoint if watch.layout is CheckpointLayout.PER_RANK else os.path.join(checkpoint, file.path)
            return Target(path, named[0])
    return Target(checkpoint, None)


def handed(spec: LaunchArgs, watch: CheckpointWatch, target: Target) -> LaunchArgs:
    """The launch with the restore's arguments appended and its variable set."""
    step = "" if target.step is None else str(target.step)
    args = [a.replace("{restore_path}", target.path).replace("{restore_step}", step) for a in watch.restore_args]
    env = dict(spec.env)
    if watch.restore_env:
        env[watch.restore_env] = target.path
    return spec.model_copy(update={"command": [*spec.command, *args], "env": env})
