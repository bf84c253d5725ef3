"""PyTorch checkpoint helpers that report what they wrote to Reprise (``pip install reprise-sdk[torch]``).

Two layouts:

* per-rank files (``save_checkpoint`` / ``load_checkpoint``): each rank writes ``rank-00003.pt`` into the checkpoint
  directory with ``torch.save``, atomically (a temporary file, fsync, rename, fsync of the directory), so a file
  that exists is complete;
* PyTorch Distributed Checkpoint (``save_distributed`` / ``load_distributed``): ``torch.distributed.checkpoint``
  writes sharded files and a ``.metadata`` file last; works with or without an initialised process group.

Every save runs in the "checkpointing" phase (a long save is not taken for a hang) and ends with
``checkpoint_saved(directory, step, files)`` listing the absolute paths of the files this rank wrote.

Checkpoints from memory (opt-in, per-rank files): with ``REPRISE_SDK_KEEP_BYTES`` set to a size, each rank keeps the
bytes of the newest file it saved (when no larger) in host memory. A rank restarted in place (``reprise_sdk.run``)
that restores a checkpoint then reads it from that copy instead of storage, but only when the copy's SHA-256 equals
the digest the registry validated for the file being loaded (the state of ``examples/ddp_train.py`` is replicated,
so every rank's copy serves rank 0's file); otherwise, and for new ranks, storage is read and checked as always.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, BinaryIO, Literal, cast, overload

import torch
import torch.distributed as dist

from ._background import (
    BackgroundStats,
    PendingSave,
    Work,
    background_stats,
    begin,
    checkpoint_group,
    finished,
    fits,
    host_copy,
    tensors_bytes,
    wait_for_saves,
)
from ._client import checkpoint_saved, phase
from ._replica import Replica, Restored, replica
from ._resume import resume
from ._verify import expected_files, verify_files, verify_share

StrPath = str | os.PathLike[str]
KEEP_ENV = "REPRISE_SDK_KEEP_BYTES"
__all__ = [
    "BackgroundStats",
    "PendingSave",
    "Replica",
    "Restored",
    "background_stats",
    "load_checkpoint",
    "load_distributed",
    "rank_file",
    "replica",
    "save_checkpoint",
    "save_distributed",
    "sha256_files",
    "wait_for_saves",
]


class _Kept:
    """The bytes of the newest checkpoint file this process saved, by SHA-256 (at most one file: the newest)."""

    def __init__(self) -> None:
        self.by_digest: dict[str, bytes] = {}
        self.restored = 0  # loads served from memory
        self.read = 0  # loads that read storage

    def limit(self) -> int:
        try:
            return max(0, int(os.environ.get(KEEP_ENV) or 0))
        except ValueError:
            return 0

    def keep_file(self, digest: str, path: Path, size: int) -> None:
        """Keep the bytes of the file just saved, when they fit the setting (read back from the page cache)."""
        self.by_digest = {digest: path.read_bytes()} if 0 < size <= self.limit() else {}


kept = _Kept()


def rank_file(directory: StrPath, rank: int) -> Path:
    """Where `rank`'s per-rank checkpoint file lives in a checkpoint directory."""
    return Path(directory).absolute() / f"rank-{rank:05d}.pt"


@overload
def save_checkpoint(
    directory: StrPath, step: int, state: dict[str, Any], *, rank: int | None = None, background: Literal[False] = False
) -> list[str]: ...


@overload
def save_checkpoint(
    directory: StrPath, step: int, state: dict[str, Any], *, rank: int | None = None, background: Literal[True]
) -> PendingSave: ...


def save_checkpoint(
    directory: StrPath, step: int, state: dict[str, Any], *, rank: int | None = None, background: bool = False
) -> list[str] | PendingSave:
    """Write this rank's `state` into `directory` atomically, report it, and return the files written.

    With ``background=True`` only a host copy of the state is taken here (after the previous background save
    finished) and a PendingSave returned: the writing, the commit and the report happen on the SDK's writer thread.
    """
    target = rank_file(directory, resume().rank if rank is None else rank)
    if background:
        nbytes = tensors_bytes(state)
        if fits(nbytes):
            return begin(str(target.parent), step, nbytes, lambda: _prepare_rank_file(target, step, state))
        return finished(str(target.parent), step, save_checkpoint(directory, step, state, rank=rank))
    with phase("checkpointing"):
        size, digest = _write_rank_file(target, step, state)
        _commit_when_all_saved(target.parent)
    return _report_rank_file(target, step, size, digest)


def _prepare_rank_file(target: Path, step: int, state: dict[str, Any]) -> Work:
    """On the training thread: the checkpoints' group (a collective, made once) and the host copy to write."""
    with phase("checkpointing"):
        group = checkpoint_group()
        snapshot = host_copy(state)

    def work(pending: PendingSave) -> list[str]:
        size, digest = _write_rank_file(target, step, snapshot)
        if pending.abandoned:
            return []
        _commit_when_all_saved(target.parent, group)
        return [] if pending.abandoned else _report_rank_file(target, step, size, digest)

    return work


def _write_rank_file(target: Path, step: int, state: dict[str, Any]) -> tuple[int, str]:
    """Serialise `state` into `target` through a temporary file (fsync, rename, fsync of the directory); the size and
    SHA-256 of the bytes written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.partial")
    try:
        with partial.open("wb") as sink:
            hashing = _HashingSink(sink)
            torch.save(state, cast(BinaryIO, hashing))  # it only ever writes and flushes
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(partial, target)
    except (OSError, RuntimeError) as exc:
        full = _out_of_space(exc)
        if full is None:
            raise
        raise OSError(errno.ENOSPC, f"no space left on the device saving {target} (step {step})") from full
    finally:
        partial.unlink(missing_ok=True)
    _fsync_directory(target.parent)
    return hashing.size, hashing.sha256.hexdigest()


def _report_rank_file(target: Path, step: int, size: int, digest: str) -> list[str]:
    files = [str(target)]
    kept.keep_file(digest, target, size)
    checkpoint_saved(str(target.parent), step, files, sha256={str(target): (size, digest)})
    return files


class _HashingSink:
    """A file that torch.save writes through, digesting the bytes on their way (no second copy of them in memory)."""

    def __init__(self, sink: BinaryIO) -> None:
        self.sink = sink
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.sink.write(data)

    def flush(self) -> None:
        self.sink.flush()


def _out_of_space(exc: BaseException) -> OSError | None:
    """The ENOSPC behind a failed save, if that is what it was (torch's writer reports it as a RuntimeError about a
    file position, with the OSError only in its context)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def sha256_files(files: list[str]) -> dict[str, tuple[int, str]]:
    """Size and SHA-256 of each file, read back right after writing (streaming, 1 MiB at a time)."""
    digests = {}
    for name in files:
        digest, size = hashlib.sha256(), 0
        with open(name, "rb") as source:
            while chunk := source.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
        digests[name] = (size, digest.hexdigest())
    return digests


COMMIT_MARKER = "COMMITTED"


def _commit_when_all_saved(directory: Path, group: Any = None) -> None:
    """Write the commit marker once every rank's file is durable: rank 0 after a barrier (on `group`, the
    checkpoints' own, from the writer thread), or the only rank.

    Without a process group, ranks of a larger world cannot know that the others finished, so none writes it and
    the registry keeps the checkpoint uncommitted (never restorable) rather than guess.
    """
    if _process_group_up():
        dist.barrier(group=group)
        if dist.get_rank() == 0:
            _write_marker(directory)
        dist.barrier(group=group)  # nobody reports the checkpoint before the marker is on storage
    elif resume().world_size <= 1:
        _write_marker(directory)


def _write_marker(directory: Path) -> None:
    marker = directory / COMMIT_MARKER
    with marker.open("wb") as sink:
        sink.flush()
        os.fsync(sink.fileno())
    _fsync_directory(directory)


def load_checkpoint(
    directory: StrPath, *, rank: int | None = None, map_location: Any = "cpu", weights_only: bool = True
) -> dict[str, Any]:
    """Read this rank's state written by save_checkpoint (tensors land on `map_location`).

    When it is the checkpoint Reprise restores, the file is first checked against the registry's digest
    (CheckpointCorruptError when it differs); a copy kept in memory with exactly that digest is read instead of the
    file (``REPRISE_SDK_KEEP_BYTES``).
    """
    source = rank_file(directory, resume().rank if rank is None else rank)
    entry = expected_files(directory).get(source.name)
    copy = kept.by_digest.get(entry.digest) if entry is not None and entry.algorithm == "sha256" else None
    if copy is not None and entry is not None and len(copy) == entry.size_bytes:  # exactly the validated bytes
        kept.restored += 1
        state: dict[str, Any] = torch.load(io.BytesIO(copy), map_location=map_location, weights_only=weights_only)
        return state
    verify_files(directory, [source.name])
    kept.read += 1
    state = torch.load(source, map_location=map_location, weights_only=weights_only)
    return state


@overload
def save_distributed(
    directory: StrPath, step: int, state: dict[str, Any], *, background: Literal[False] = False
) -> list[str]: ...


@overload
def save_distributed(
    directory: StrPath, step: int, state: dict[str, Any], *, background: Literal[True]
) -> PendingSave: ...


def save_distributed(
    directory: StrPath, step: int, state: dict[str, Any], *, background: bool = False
) -> list[str] | PendingSave:
    """Save `state` with torch.distributed.checkpoint (a collective under a process group); report this rank's files.

    With ``background=True``, DCP's asynchronous save stages the state in host memory here and writes it on its own
    thread, coordinating the ranks over the checkpoints' gloo group; the report follows its ``.metadata``.
    """
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 - heavy, and only this pair of helpers needs it

    root = Path(directory).absolute()
    grouped = _process_group_up()
    if background:
        nbytes = tensors_bytes(state)
        if fits(nbytes):
            return begin(str(root), step, nbytes, lambda: _prepare_distributed(root, step, state))
        return finished(str(root), step, save_distributed(directory, step, state))
    with phase("checkpointing"), _single_process_is_meant(not grouped):
        metadata = dcp.save(state, checkpoint_id=root, no_dist=not grouped)
    return _report_distributed(root, step, metadata)


def _prepare_distributed(root: Path, step: int, state: dict[str, Any]) -> Work:
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    grouped = _process_group_up()
    with phase("checkpointing"), _single_process_is_meant(not grouped):
        group = checkpoint_group()
        saving = dcp.async_save(state, checkpoint_id=root, process_group=group, no_dist=not grouped)
        future = cast(Future[Any], saving)  # a Future unless an async stager is given, and none is

    def work(pending: PendingSave) -> list[str]:
        metadata = future.result()
        return [] if pending.abandoned else _report_distributed(root, step, metadata)

    return work


def _report_distributed(root: Path, step: int, metadata: Any) -> list[str]:
    rank = dist.get_rank() if _process_group_up() else 0
    prefix = f"__{rank}_"  # FileSystemWriter names a rank's files __<rank>_<n>.distcp
    names = {info.relative_path for info in metadata.storage_data.values() if info.relative_path.startswith(prefix)}
    if rank == 0:
        names.add(".metadata")  # the coordinator writes the metadata, last
    files = [str(root / name) for name in sorted(names)]
    checkpoint_saved(str(root), step, files, sha256=sha256_files(files))
    return files


def load_distributed(directory: StrPath, state: dict[str, Any]) -> dict[str, Any]:
    """Load a torch.distributed.checkpoint into `state` in place (its tensors give shapes and placement).

    When it is the checkpoint Reprise restores, each rank first checks its share of the files (and every rank the
    .metadata) against the registry's digests (CheckpointCorruptError when one differs).
    """
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    grouped = _process_group_up()
    me, world = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
    if expected_files(directory):
        verify_files(directory, [".metadata"])
        verify_share(directory, rank=me, world_size=world)
    with _single_process_is_meant(not grouped):
        dcp.load(state, checkpoint_id=Path(directory).absolute(), no_dist=not grouped)
    return state


def _process_group_up() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_is_meant(single: bool) -> Iterator[None]:
    """Without a process group DCP warns that it assumes a single process: here that is what the caller meant."""
    with warnings.catch_warnings():
        if single:
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable: the directory entry is only on disk once the directory is synced."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
