"""Acceptance: writers killed at 200 random points plus byte flips: no torn checkpoint is validated or latest."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from reprise_cli.servers import free_port

from .torn import campaign, start_registry, wait_healthy

RUNS = 200


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    proc = start_registry(tmp_path, port)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.mark.timeout(180)
def test_no_torn_or_flipped_checkpoint_is_ever_validated_or_latest(registry: str, tmp_path: Path) -> None:
    stats = campaign(registry, tmp_path / "ckpt", job="torn", runs=RUNS, parallel=8, seed=20261129)
    print(stats)
    assert stats.violations == []
    assert stats.runs == RUNS and stats.killed >= RUNS // 2, stats  # most writers really died mid-way (~3 in 4 by plan)
    # The campaign must have produced each outcome, or it proved nothing; every flipped checkpoint must be corrupt
    # (torn writes that reached a commit add to that count: a marker or early reports before the last chunk).
    assert stats.states.get("writing", 0) > 0 and stats.states.get("corrupt", 0) >= stats.flipped > 0, stats
    assert stats.states.get("validated", 0) > 0, stats
