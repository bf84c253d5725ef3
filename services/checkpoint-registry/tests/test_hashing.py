"""Digests of real files match the reference implementations, across buffer boundaries and in parallel."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import blake3
import pytest

from reprise_registry.checkpoints.models import Algorithm
from reprise_registry.checkpoints.service import manifest_digest
from reprise_registry.validation.hashing import BUFFER_BYTES, FileDigestResult, hash_file, hash_files

SIZES = [0, 1, BUFFER_BYTES - 1, BUFFER_BYTES, BUFFER_BYTES + 1, 2 * BUFFER_BYTES + 12345]


@pytest.mark.parametrize("size", SIZES)
def test_streamed_digests_equal_the_references(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert hash_file(path, Algorithm.SHA256).digest == hashlib.sha256(data).hexdigest()
    result = hash_file(path)
    assert result.digest == blake3.blake3(data).hexdigest() and result.size_bytes == size


def test_parallel_hashing_keeps_order_and_reports_unreadable_files(tmp_path: Path) -> None:
    paths = []
    for index in range(12):
        path = tmp_path / f"r{index}.bin"
        path.write_bytes(os.urandom(1000 + index))
        paths.append(path)
    paths.insert(5, tmp_path / "missing.bin")
    results = hash_files(paths, workers=4)
    assert isinstance(results[5], FileNotFoundError)
    for path, result in zip(paths, results, strict=True):
        if path.name != "missing.bin":
            assert isinstance(result, FileDigestResult)
            assert result.path == path and result.digest == blake3.blake3(path.read_bytes()).hexdigest()


def test_manifest_digest_depends_on_every_entry_but_not_on_order() -> None:
    entries = [("a", 1, "00" * 32, "blake3"), ("b", 2, "11" * 32, "blake3")]
    assert manifest_digest(entries) == manifest_digest(list(reversed(entries)))
    assert manifest_digest(entries) != manifest_digest([entries[0], ("b", 3, "11" * 32, "blake3")])


def test_a_symlink_is_not_opened_when_links_are_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "outside.bin"
    target.write_bytes(b"x" * 100)
    (tmp_path / "link.bin").symlink_to(target)
    assert hash_file(tmp_path / "link.bin").size_bytes == 100
    with pytest.raises(OSError):  # ELOOP: validation opens resolved paths only, a link swapped in is refused
        hash_file(tmp_path / "link.bin", follow_symlinks=False)
