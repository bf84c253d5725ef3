"""Cross-service fixtures: the whole platform as processes (`stack`), and the fuzz's summary, one line per service in
pytest's terminal summary, so a plain `pytest` (make test) shows it."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from reprise_cli.slurm import slurm_unavailable_reason
from reprise_cli.stack import Stack
from reprise_cli.topology import StackConfig

_FUZZ_LINES = pytest.StashKey[list[str]]()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """`reprise up` on free ports: two workers with four simulated GPUs each and a spare."""
    running = Stack(StackConfig(nodes=2, spares=1, gpus_per_node=4, state_dir=tmp_path / "state"), free_ports=True)
    try:
        running.start(timeout_s=60)
        yield running
    finally:
        running.stop()


@pytest.fixture
def slurm_state_dir() -> Iterator[Path]:
    """A short state directory for a stack on a local Slurm cluster (slurmd's step sockets live under it and a Unix
    socket path has at most 107 bytes); skipped, with the reason, where Slurm cannot run."""
    reason = slurm_unavailable_reason()
    if reason is not None:
        pytest.skip(f"Slurm tests not run: {reason}")
    directory = Path(tempfile.mkdtemp(prefix="rs-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def fuzz_report(request: pytest.FixtureRequest) -> list[str]:
    """Lines to show in the summary's "OpenAPI fuzz" section."""
    return request.config.stash.setdefault(_FUZZ_LINES, [])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Print each service's fuzz line (cases sent, server errors, failures) after the run."""
    lines = config.stash.get(_FUZZ_LINES, [])
    if lines:
        terminalreporter.section("OpenAPI fuzz")
        for line in lines:
            terminalreporter.write_line(line)
