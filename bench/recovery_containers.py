"""The container cells of bench_recovery: the same job and faults with each rank in a container (docs/containers.md).

The stack runs a dockerd of its own and imports the base image built from Debian's packages; its agents get the
daemon's URL and the mount roots. The job is the process cells' with a `container` section: the base image, the
host's Python and the checkout's .venv, SDK and examples read-only, its own directory (checkpoints) read-write under
the stack's jobs directory, which is also its working directory. On the fast path the agents keep standby containers
of the job's image, on its nodes and (told at each launch) on the spares, so a replaced rank starts in a container
that imported torch already.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reprise_cli.demo.training import container_section
from reprise_cli.stack import Stack


def job_root(stack: Stack) -> Path:
    """The job's own directory, under the nodes' mount roots (and away from the daemon's socket)."""
    path = stack.config.jobs_dir / "job"
    path.mkdir(parents=True, exist_ok=True)
    return path


def containerized(body: dict[str, Any], stack: Stack, root: Path) -> dict[str, Any]:
    """The job's body with each rank in a container of the stack's base image, working in `root`."""
    assert stack.container_image is not None, "the stack runs no dockerd"
    return body | {"working_dir": str(root), "container": container_section(stack.container_image, work_dir=root)}
