"""What a node lets a containerized job use (host paths under its mount roots, an optional image allow-list), and
the errors a container launch ends in: refused (the same on every try) or the daemon unavailable (a dependency)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from reprise_common.errors import DependencyUnavailableError, RepriseError
from reprise_common.events import LaunchArgs, mount_refusal


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
    only those images (the rules that need no settings are in the ContainerSpec model)."""

    mount_roots: tuple[Path, ...] = ()
    images: frozenset[str] | None = None

    def check(self, spec: LaunchArgs) -> None:
        """Raise LaunchRefusedError naming the field when the job's container spec breaks a rule of this node."""
        container = spec.container
        assert container is not None
        if self.images is not None and container.image not in self.images:
            raise LaunchRefusedError(f"container.image {container.image!r} is not on this node's image allow-list")
        sources = [(f"container.mounts[{n}].source", m.source) for n, m in enumerate(container.mounts)]
        if spec.checkpoints is not None:
            sources.append(("checkpoints.directory", spec.checkpoints.directory))
        for name, source in sources:
            real = os.path.realpath(source)  # a symlink must not lead around the rules
            why = mount_refusal(real)
            if why is None and not any(_under(Path(real), root) for root in self.mount_roots):
                why = f"{real} is outside this node's mount roots ({', '.join(map(str, self.mount_roots)) or 'none'})"
            if why is not None:
                raise LaunchRefusedError(f"{name} refused: {why}")


def _under(path: Path, root: Path) -> bool:
    real_root = Path(os.path.realpath(root))
    return path == real_root or real_root in path.parents
