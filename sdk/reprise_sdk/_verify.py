"""Checking the files of the checkpoint a rank resumes from against the digests the registry validated.

The agent hands each rank the registry's manifest of the checkpoint it restores (``REPRISE_RESUME_FILES``, a JSON
list of path, size, algorithm and digest). A file that differs, in size or in content, raises CheckpointCorruptError
before anything is loaded: the rank exits before its first step, the orchestrator reports the load failure, the
registry re-hashes the checkpoint, marks it corrupt, and the next recovery attempt restores the one before.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILES_ENV = "REPRISE_RESUME_FILES"
CHECKPOINT_ENV = "REPRISE_RESUME_CHECKPOINT"
_CHUNK = 1 << 20


class CheckpointCorruptError(RuntimeError):
    """A file of the checkpoint being restored is not what the registry validated."""


@dataclass(frozen=True, slots=True)
class ExpectedFile:
    """One file as the registry validated it."""

    path: str
    size_bytes: int
    algorithm: str
    digest: str


def expected_files(directory: str | os.PathLike[str], env: Mapping[str, str] = os.environ) -> dict[str, ExpectedFile]:
    """The registry's manifest when `directory` is the checkpoint Reprise restores ({}: nothing to check here)."""
    listing, restored = env.get(FILES_ENV, ""), env.get(CHECKPOINT_ENV, "")
    if not listing or not restored or os.path.realpath(restored) != os.path.realpath(directory):
        return {}
    entries: list[dict[str, Any]] = json.loads(Path(listing).read_text(encoding="utf-8"))
    return {e["path"]: ExpectedFile(e["path"], int(e["size_bytes"]), e["algorithm"], e["digest"]) for e in entries}


def verify_files(directory: str | os.PathLike[str], names: Iterable[str], env: Mapping[str, str] = os.environ) -> int:
    """Check the named files (relative to `directory`) against the registry's digests; how many were checked.

    Raises CheckpointCorruptError naming the first file that is missing from the manifest, or differs from it.
    Outside a Reprise restore (no manifest for this directory) nothing is checked.
    """
    expected = expected_files(directory, env)
    if not expected:
        return 0
    checked = 0
    for name in names:
        entry = expected.get(name)
        if entry is None:
            raise CheckpointCorruptError(f"{name} is not a file of the validated checkpoint {directory}")
        try:
            size, digest = _digest(Path(directory) / name, entry.algorithm)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{name} of the validated checkpoint {directory} is missing") from None
        if size != entry.size_bytes:
            raise CheckpointCorruptError(f"{name} is {size} bytes; the registry validated {entry.size_bytes}")
        if digest is not None and digest != entry.digest:
            raise CheckpointCorruptError(
                f"{name}: {entry.algorithm} {digest[:16]}… differs from the validated {entry.digest[:16]}…"
            )
        checked += 1
    return checked


def verify_share(directory: str | os.PathLike[str], *, rank: int, world_size: int) -> int:
    """Check this rank's share of the whole manifest (every world_size-th file), so the ranks together check all."""
    names = sorted(expected_files(directory))
    return verify_files(directory, names[rank % world_size :: world_size])


def _digest(path: Path, algorithm: str) -> tuple[int, str | None]:
    """Size and digest of a file (digest None where the algorithm is unavailable here: its size is still checked)."""
    hasher = _hasher(algorithm)
    size = 0
    with path.open("rb") as source:
        while chunk := source.read(_CHUNK):
            size += len(chunk)
            if hasher is not None:
                hasher.update(chunk)
    return size, hasher.hexdigest() if hasher is not None else None


def _hasher(algorithm: str) -> Any:
    if algorithm == "sha256":  # what the SDK reports for every file it writes
        return hashlib.sha256()
    try:
        import blake3  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415 - optional
    except ImportError:
        warnings.warn(f"blake3 is not installed: only the sizes of {algorithm} files are checked", stacklevel=4)
        return None
    return blake3.blake3()
