"""A real Docker Engine for the container launcher's tests: a dockerd of our own (installed with apt-get when missing,
as root), its socket and data under a temp directory, the ranks' base image built from Debian's packages and cached
on this machine (reprise_cli.dockerd). Skipped, with the reason, only where no dockerd can be installed or started."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from reprise_cli.dockerd import DockerDaemon, ensure_base_image
from reprise_common.errors import ConfigError
from reprise_common.events import ContainerMount

REPO = Path(__file__).resolve().parents[4]


@dataclass(frozen=True)
class Engine:
    """The test session's daemon and the image its ranks run in."""

    url: str
    image: str


@pytest.fixture(scope="session")
def docker_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A dockerd of the session's own with the base image in it; stopped (its containers with it) at the end."""
    daemon = DockerDaemon(tmp_path_factory.mktemp("dockerd"))
    try:
        daemon.start()
    except ConfigError as exc:
        pytest.skip(f"no Docker Engine here: {exc}")
    try:
        yield Engine(daemon.url, ensure_base_image(daemon.url))
    finally:
        daemon.stop()


def python_mounts() -> list[ContainerMount]:
    """The host's interpreter and this checkout (its .venv, the editable packages) at their own paths, read-only:
    a rank in the base image runs the same Python, torch and SDK as a process would (docs/containers.md)."""
    return [
        ContainerMount(source=os.path.realpath(sys.base_prefix), target=os.path.realpath(sys.base_prefix)),
        ContainerMount(source=str(REPO), target=str(REPO)),
    ]


PYTHON = sys.executable  # the checkout's .venv/bin/python: found in the container through the mounts above


def open_home(tmp_path: Path) -> ContainerMount:
    """For a container whose user is not root: the host's interpreter may live under /root, which the image keeps to
    root (mode 0700), so an open directory is mounted over it (the interpreter's own mount goes inside)."""
    home = tmp_path / "home"
    home.mkdir(mode=0o755, exist_ok=True)
    return ContainerMount(source=str(home), target="/root", read_only=False)
