"""Fast file digests: streaming with large reused buffers, parallel over files, BLAKE3 by default, SHA-256 available.

Both hashers release the GIL while they hash a large buffer, so threads hash different files in parallel; BLAKE3
additionally spreads one large buffer over several cores itself.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import blake3

from reprise_registry.checkpoints.models import Algorithm

BUFFER_BYTES = 1024 * 1024  # fits in L2: larger buffers measured slower (copy out of cache)
_MULTITHREAD_FROM_BYTES = 4 * 1024 * 1024  # BLAKE3's own threads pay off only on large inputs
_local = threading.local()
T = TypeVar("T")
R = TypeVar("R")


class Hasher(Protocol):
    """What hashlib and blake3 hashers share."""

    def update(self, data: memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


@dataclass(frozen=True)
class FileDigestResult:
    """A file's size as read and its digest."""

    path: Path
    size_bytes: int
    digest: str


def new_hasher(algorithm: Algorithm, *, size_hint: int = 0) -> Hasher:
    """A fresh hasher for the algorithm; BLAKE3 uses its own threads for inputs of several MiB."""
    if algorithm is Algorithm.SHA256:
        return hashlib.sha256()
    threads = blake3.blake3.AUTO if size_hint >= _MULTITHREAD_FROM_BYTES else 1
    return blake3.blake3(max_threads=threads)


def _buffer() -> bytearray:
    buffer: bytearray | None = getattr(_local, "buffer", None)
    if buffer is None:
        buffer = bytearray(BUFFER_BYTES)
        _local.buffer = buffer
    return buffer


def hash_file(
    path: str | os.PathLike[str], algorithm: Algorithm = Algorithm.BLAKE3, *, follow_symlinks: bool = True
) -> FileDigestResult:
    """Stream one file through the hasher with a per-thread reused buffer (no per-read allocation).

    With follow_symlinks=False a path whose last component is a symlink is not opened (OSError, ELOOP).
    """
    buffer = _buffer()
    view = memoryview(buffer)
    size = 0
    flags = 0 if follow_symlinks else os.O_NOFOLLOW
    with open(path, "rb", buffering=0, opener=lambda name, mode: os.open(name, mode | flags)) as source:
        hasher = new_hasher(algorithm, size_hint=os.fstat(source.fileno()).st_size)
        while True:
            count = source.readinto(buffer)
            if not count:
                break
            hasher.update(view[:count])
            size += count
    return FileDigestResult(path=Path(path), size_bytes=size, digest=hasher.hexdigest())


def hash_bytes(data: bytes, algorithm: Algorithm = Algorithm.BLAKE3) -> str:
    """The digest of bytes in memory (what a writer computes while it writes)."""
    hasher = new_hasher(algorithm, size_hint=len(data))
    hasher.update(memoryview(data))
    return hasher.hexdigest()


def hash_files(
    paths: Sequence[str | os.PathLike[str]],
    algorithm: Algorithm = Algorithm.BLAKE3,
    *,
    workers: int | None = None,
) -> list[FileDigestResult | OSError]:
    """Hash many files in parallel; each result is in the order of `paths`, an OSError where a file is unreadable."""
    return parallel_map(lambda p: hash_file(p, algorithm), paths, workers=workers)


def parallel_map(function: Callable[[T], R], items: Sequence[T], *, workers: int | None = None) -> list[R | OSError]:
    """Apply `function` to each item on a thread pool, keeping OSErrors as results rather than raising."""

    def safe(item: T) -> R | OSError:
        try:
            return function(item)
        except OSError as exc:
            return exc

    if len(items) <= 1:
        return [safe(item) for item in items]
    count = min(len(items), workers or default_workers())
    with ThreadPoolExecutor(max_workers=count, thread_name_prefix="hash") as pool:
        return list(pool.map(safe, items))


def default_workers() -> int:
    """Hash threads: one per core, at least two (reads overlap hashing), at most 32."""
    return max(2, min(32, os.cpu_count() or 2))
