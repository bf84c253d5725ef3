"""What every framework integration does after the framework wrote a checkpoint: make it durable, commit, report.

The frameworks write with plain ``torch.save`` or safetensors (no fsync), and in a distributed run different ranks
write different files of one directory. Reprise's registry commits a checkpoint once every rank of the world reported
its part and the ``COMMITTED`` marker is in its directory. So after the framework's save and a barrier, rank 0 syncs
and reports every file of the directory with its SHA-256 and writes the marker after a second barrier; the other
ranks report an empty part.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from .._client import checkpoint_saved
from .._resume import resume
from .._verify import expected_files, verify_files
from ..torch import COMMIT_MARKER, _commit_when_all_saved, _fsync_directory, sha256_files


def forget_commit(directory: str | os.PathLike[str]) -> None:
    """Remove an old marker before a checkpoint of the same step is written again over it (rank 0 only)."""
    if resume().rank == 0:
        (Path(directory) / COMMIT_MARKER).unlink(missing_ok=True)


def commit_and_report(directory: str | os.PathLike[str], step: int, files: Iterable[str | os.PathLike[str]]) -> None:
    """Sync the files this rank reports, commit the checkpoint once every rank's are durable, and report them.

    A collective when a process group is up: every rank calls it after the framework's save, those that report
    nothing with no files.
    """
    root = Path(directory).absolute()
    written = [str(Path(f).absolute()) for f in files]
    for name in written:
        _fsync_file(name)
    if written:
        for parent in {Path(name).parent for name in written}:
            _fsync_directory(parent)
    _commit_when_all_saved(root)
    checkpoint_saved(str(root), step, written, sha256=sha256_files(written))


def wait_for_every_rank() -> None:
    """A barrier when a process group is up: after it, every rank's part of a save is on storage."""
    import torch.distributed as dist  # noqa: PLC0415 - the frameworks imported it already

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def files_written(directory: str | os.PathLike[str]) -> list[str]:
    """Every file under `directory` (recursively, sorted; symlinks and the marker left out): what the ranks wrote."""
    found = (p for p in Path(directory).absolute().rglob("*") if p.is_file() and not p.is_symlink())
    return sorted(str(p) for p in found if p.name != COMMIT_MARKER)


def verified_restore_point() -> str | None:
    """The checkpoint Reprise restores (None for a fresh start), every file of its manifest checked against the
    registry's digests first: CheckpointCorruptError names one that differs, before the framework reads anything."""
    checkpoint = resume().checkpoint
    if checkpoint is not None:
        verify_files(checkpoint, sorted(expected_files(checkpoint)))
    return checkpoint


def _fsync_file(name: str) -> None:
    fd = os.open(name, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
