"""The checks that prove a checkpoint intact, each returning a reason when it is not.

Order matters for cost: completeness and sizes need only metadata (stat), DCP metadata one small read, digests the
whole of every sampled file. Nothing is read outside the checkpoint's directory, itself inside the roots: a stored
path that leaves them (or a symlink swapped in since it was reported) makes the checkpoint corrupt instead.
"""

from __future__ import annotations

import math
import os
import random
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from reprise_registry.checkpoints import paths
from reprise_registry.checkpoints.models import Algorithm, Checkpoint, Layout
from reprise_registry.checkpoints.paths import PathRefusedError
from reprise_registry.validation.hashing import FileDigestResult, hash_file, parallel_map

STAT_BATCH = 1024


class Failure(StrEnum):
    """Why a checkpoint is corrupt (the first word of its reason)."""

    INCOMPLETE = "incomplete"
    MISSING_MARKER = "missing_marker"
    MISSING_FILE = "missing_file"
    SIZE_MISMATCH = "size_mismatch"
    DIGEST_MISMATCH = "digest_mismatch"
    UNREADABLE = "unreadable"
    DCP_METADATA = "dcp_metadata"
    OUTSIDE = "outside_checkpoint"


@dataclass(frozen=True)
class ManifestFile:
    """One file of the manifest as validation needs it."""

    path: str
    rank: int
    size_bytes: int
    digest: str | None
    algorithm: Algorithm


@dataclass
class Verdict:
    """The outcome of one validation."""

    reason: str = ""
    computed: dict[str, str] = field(default_factory=dict)  # digests computed for files reported without one
    hashed_files: int = 0
    hashed_bytes: int = 0

    @property
    def ok(self) -> bool:
        """True when every check passed."""
        return not self.reason


def validate(
    checkpoint: Checkpoint,
    *,
    ranks: set[int],
    files: Sequence[ManifestFile],
    sample_fraction: float,
    workers: int | None = None,
    rng: random.Random | None = None,
    roots: Sequence[Path],
) -> Verdict:
    """Run every check on a committed checkpoint; the first failure decides the reason."""
    expected = set(range(checkpoint.world_size or 0))
    if not expected or ranks != expected:
        missing = sorted(expected - ranks)[:20]
        return Verdict(reason=f"{Failure.INCOMPLETE}: ranks {missing} did not report (world size {len(expected)})")
    try:
        root = paths.checkpoint_directory(checkpoint.path, roots)
        marker = paths.marker_present(root, checkpoint.marker)
    except PathRefusedError as exc:
        return Verdict(reason=f"{Failure.OUTSIDE}: {exc}")
    if not marker:
        return Verdict(reason=f"{Failure.MISSING_MARKER}: {checkpoint.marker} not found in {root}")
    reason = check_sizes(root, files, workers=workers)
    if reason:
        return Verdict(reason=reason)
    if checkpoint.layout == Layout.DCP:
        reason = check_dcp_metadata(root, {f.path for f in files})
        if reason:
            return Verdict(reason=reason)
    return check_digests(root, files, sample_fraction=sample_fraction, workers=workers, rng=rng)


def check_sizes(root: Path, files: Sequence[ManifestFile], *, workers: int | None = None) -> str:
    """Every file exists inside `root` (resolved) with the size it was reported with."""
    # stat is microseconds: one pool task per file would cost more than the call, so files go in batches, each
    # stat-ed relative to one open directory descriptor (no full path resolution per file). Containment costs no
    # more: each distinct subdirectory is resolved once, each file lstat-ed, and only a symlink resolved in full.
    reason = _outside_subdirectory(root, files)
    if reason:
        return reason
    batches = [files[i : i + STAT_BATCH] for i in range(0, len(files), STAT_BATCH)]
    try:
        directory = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        return f"{Failure.UNREADABLE}: {root}: {exc}"
    try:
        sizes = parallel_map(lambda batch: [_size(f.path, directory, root) for f in batch], batches, workers=workers)
    finally:
        os.close(directory)
    stats = [size for batch in sizes for size in (batch if isinstance(batch, list) else [batch])]
    reasons = (_size_reason(entry, size) for entry, size in zip(files, stats, strict=True))
    return next((reason for reason in reasons if reason), "")


def _size_reason(entry: ManifestFile, size: int | OSError | PathRefusedError) -> str:
    if isinstance(size, PathRefusedError):
        return f"{Failure.OUTSIDE}: {entry.path} (rank {entry.rank}) {size.reason}"
    if isinstance(size, FileNotFoundError):
        return f"{Failure.MISSING_FILE}: {entry.path} (rank {entry.rank}) is missing"
    if isinstance(size, OSError):
        return f"{Failure.UNREADABLE}: {entry.path}: {size}"
    if size != entry.size_bytes:
        return f"{Failure.SIZE_MISMATCH}: {entry.path} is {size} bytes, the manifest says {entry.size_bytes}"
    return ""


def _outside_subdirectory(root: Path, files: Sequence[ManifestFile]) -> str:
    subdirectories = {f.path.rpartition("/")[0] for f in files} - {""}
    for subdirectory in sorted(subdirectories):
        try:
            paths.readable(root, subdirectory, field=("path",))
        except PathRefusedError:
            entry = next(f for f in files if f.path.rpartition("/")[0] == subdirectory)
            return f"{Failure.OUTSIDE}: {entry.path} (rank {entry.rank}) resolves outside the checkpoint's directory"
    return ""


def _size(relative: str, directory: int, root: Path) -> int | OSError | PathRefusedError:
    if not paths.plain_relative(relative):  # an absolute path would make stat ignore the directory descriptor
        return PathRefusedError(("path",), "points outside the checkpoint's directory", relative)
    try:
        info = os.stat(relative, dir_fd=directory, follow_symlinks=False)
        if stat.S_ISLNK(info.st_mode):
            info = os.stat(paths.readable(root, relative, field=("path",)))
        return info.st_size
    except PathRefusedError as exc:
        return PathRefusedError(exc.field, "resolves outside the checkpoint's directory (a symlink)", relative)
    except OSError as exc:
        return exc


def check_dcp_metadata(root: Path, manifest: set[str]) -> str:
    """The DCP .metadata file loads, and every file it references is in the manifest (skipped without torch)."""
    try:
        from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415 - optional and heavy
    except ImportError:
        return ""
    try:
        paths.readable(root, ".metadata", field=("marker",))  # the reader opens it whatever the marker is called
    except PathRefusedError as exc:
        return f"{Failure.OUTSIDE}: {exc}"
    try:
        metadata = FileSystemReader(str(root)).read_metadata()
    except Exception as exc:  # any failure to unpickle means a restore would fail the same way
        return f"{Failure.DCP_METADATA}: .metadata unreadable: {type(exc).__name__}: {str(exc)[:200]}"
    storage = metadata.storage_data or {}
    referenced = {info.relative_path for info in storage.values() if hasattr(info, "relative_path")}
    absent = sorted(referenced - manifest)
    if absent:
        return f"{Failure.DCP_METADATA}: .metadata references files no rank reported: {absent[:5]}"
    return ""


def sample(files: Sequence[ManifestFile], fraction: float, rng: random.Random) -> list[ManifestFile]:
    """Files whose digests to verify: a fraction of them chosen at random, plus every one without a digest yet."""
    unknown = [f for f in files if f.digest is None]
    known = [f for f in files if f.digest is not None]
    if fraction >= 1.0:
        return unknown + known
    count = min(len(known), math.ceil(fraction * len(known))) if fraction > 0 else 0
    return unknown + rng.sample(known, count)


def check_digests(
    root: Path,
    files: Sequence[ManifestFile],
    *,
    sample_fraction: float,
    workers: int | None = None,
    rng: random.Random | None = None,
) -> Verdict:
    """Re-hash the sampled files (in parallel) and compare with the reported digests."""
    chosen = sample(files, sample_fraction, rng or random.Random())  # noqa: S311 - sampling, not secrecy
    results = parallel_map(lambda f: _hash_inside(root, f), chosen, workers=workers)
    verdict = Verdict(hashed_files=len(chosen))
    for entry, result in zip(chosen, results, strict=True):
        if isinstance(result, PathRefusedError):
            verdict.reason = f"{Failure.OUTSIDE}: {entry.path} (rank {entry.rank}) {result.reason}"
            return verdict
        if isinstance(result, OSError):
            verdict.reason = f"{Failure.UNREADABLE}: {entry.path}: {result}"
            return verdict
        assert isinstance(result, FileDigestResult)
        verdict.hashed_bytes += result.size_bytes
        if result.size_bytes != entry.size_bytes:
            verdict.reason = f"{Failure.SIZE_MISMATCH}: {entry.path} changed size while being read"
            return verdict
        if entry.digest is None:
            verdict.computed[entry.path] = result.digest
        elif result.digest != entry.digest:
            verdict.reason = (
                f"{Failure.DIGEST_MISMATCH}: {entry.path} (rank {entry.rank}) {entry.algorithm} is "
                f"{result.digest[:16]}…, the manifest says {entry.digest[:16]}…"
            )
            return verdict
    return verdict


def _hash_inside(root: Path, entry: ManifestFile) -> FileDigestResult | PathRefusedError:
    """Hash a file after checking, right before opening it, that it resolves inside the checkpoint's directory."""
    try:
        target = paths.readable(root, entry.path, field=("path",))
    except PathRefusedError as exc:
        return exc
    return hash_file(target, entry.algorithm, follow_symlinks=False)  # resolved: a link swapped in now is refused
