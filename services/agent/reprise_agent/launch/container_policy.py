"""What a node lets a containerized job use (host paths under its mount roots, an optional image allow-list), and
the errors a container launch ends in: refused (the same on every try) or the daemon unavailable (a dependency)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from reprise_common.errors import DependencyUnavailableError, RepriseError
from reprise_common.events import ContainerSupport, LaunchArgs, field_name


class ContainerLaunchError(RepriseError):
    """A rank's container could not be started; `retryable` says whether trying again may help."""

    retryable = False


class LaunchRefusedError(ContainerLaunchError):
    """The job's container spec is refused here, or its image is missing, or the daemon refused the container: the
    same launch fails the same way on every try (the message names the field or the image)."""


class DockerUnavailableError(DependencyUnavailableError, ContainerLaunchError):
    """The Docker daemon did not answer: a dependency fault of the node, not of the job."""

    dependency = "the Docker daemon"
    retryable = True


@dataclass(frozen=True)
class ContainerPolicy:
    """What this node lets a job's containers use: host paths under `mount_roots` only, and, when `images` is set,
    only those images (the rules that need no settings are in the ContainerSpec model). Its node reports carry it
    (`support`), so the orchestrator applies the same rule at submission and placement."""

    mount_roots: tuple[Path, ...] = ()
    images: frozenset[str] | None = None

    def support(self) -> ContainerSupport:
        """The policy as the node's reports carry it: each root as configured and with its symlinks resolved, since
        the orchestrator judges a job's paths as written."""
        images = None if self.images is None else sorted(self.images)
        roots = {path: None for root in self.mount_roots for path in (os.path.abspath(root), os.path.realpath(root))}
        return ContainerSupport(mount_roots=list(roots), images=images)

    def check(self, spec: LaunchArgs) -> None:
        """Raise LaunchRefusedError naming the field when the job's container spec breaks a rule of this node (every
        path with its symlinks resolved here: a symlink must not lead around the rules)."""
        assert spec.container is not None
        checkpoints = spec.checkpoints.directory if spec.checkpoints is not None else None
        refused = self.support().refusal(spec.container, checkpoints, real=os.path.realpath)
        if refused is not None:
            field, why = refused
            raise LaunchRefusedError(f"{field_name(field)} refused: {why}")
