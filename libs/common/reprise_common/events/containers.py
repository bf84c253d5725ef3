"""A job's ranks in a container image: what the job spec asks for (image, mounts, limits, capabilities), and the safety
rules that need no settings. Where a spec may mount from and which images it may name are settings of the agent
(docs/containers.md), which its node reports carry (ContainerSupport): the node applies them at launch with symlinks
resolved, the orchestrator at submission and placement as written; the rules here refuse what no setting can make
safe.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from typing import Annotated

from pydantic import Field, field_validator

from reprise_common.events.base import Wire

# Capabilities a rank may add: pinned memory for RDMA (IPC_LOCK), thread priorities (SYS_NICE), reading its own
# processes' memory (SYS_PTRACE: py-spy inside the container). Anything else (SYS_ADMIN, NET_ADMIN, ...) reaches the
# node, not just the rank.
CAPABILITIES_ALLOWED = frozenset({"IPC_LOCK", "SYS_NICE", "SYS_PTRACE"})
# The Docker socket, wherever a distribution puts it: a rank that reaches it owns the node.
DOCKER_SOCKETS = ("/var/run/docker.sock", "/run/docker.sock", "/var/run/docker", "/run/docker")
MOUNTS_MAX = 64
MIB = 1024 * 1024
ROOTS_MAX = 256  # mount roots a node reports
IMAGES_MAX = 1024  # images on a node's allow-list


def mount_refusal(source: str) -> str | None:
    """Why a host path may never be mounted into a rank's container (None: this rule allows it)."""
    if not posixpath.isabs(source):
        return f"{source!r} is not an absolute path"
    path = posixpath.normpath(source)
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    if path == "/":
        return "the host's root file system"
    if posixpath.basename(path) == "docker.sock":
        return f"{path} is a Docker socket"
    for sock in DOCKER_SOCKETS:
        if sock == path or sock.startswith(path + "/"):
            return f"{path} is or holds the Docker socket {sock}"
    return None


class ContainerMount(Wire):
    """A host path bound into the rank's container."""

    source: str = Field(min_length=1, max_length=4096, description="absolute host path")
    target: str = Field(min_length=1, max_length=4096, description="absolute path in the container")
    read_only: bool = True

    @field_validator("source")
    @classmethod
    def _safe_source(cls, source: str) -> str:
        why = mount_refusal(source)
        if why is not None:
            raise ValueError(f"mounts.source refused: {why}")
        return posixpath.normpath(source)

    @field_validator("target")
    @classmethod
    def _absolute_target(cls, target: str) -> str:
        if not posixpath.isabs(target):
            raise ValueError(f"mounts.target {target!r} is not an absolute path")
        return posixpath.normpath(target)


Capability = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Z_]+$")]


class ContainerSpec(Wire):
    """Run each rank of the job in a container of `image`, on the host's network, with these mounts and limits."""

    image: str = Field(min_length=1, max_length=512, description="a local image: nothing is pulled")
    mounts: list[ContainerMount] = Field(default_factory=list, max_length=MOUNTS_MAX)
    memory_bytes: int | None = Field(default=None, ge=16 * MIB, le=1 << 46, description="hard memory limit; None: none")
    cpus: float | None = Field(default=None, gt=0, le=1024, description="CPU limit in cores; None: none")
    pids_limit: int | None = Field(default=None, ge=16, le=4_194_304, description="most processes; None: none")
    shm_bytes: int | None = Field(
        default=None, ge=MIB, le=1 << 40, description="shared memory size (NCCL wants more than 64 MiB)"
    )
    cap_add: list[Capability] = Field(default_factory=list, max_length=16, description="added capabilities")
    user: str | None = Field(
        default=None, max_length=64, description="the image's user to run as (a name, or uid[:gid]); None: the image's"
    )
    privileged: bool = Field(default=False, description="always refused: kept so that asking for it says why")
    pid_mode: str | None = Field(default=None, max_length=64, description="'host' is refused; None: the container's")

    @field_validator("privileged")
    @classmethod
    def _not_privileged(cls, privileged: bool) -> bool:
        if privileged:
            raise ValueError("privileged containers are refused: they reach every device and capability of the node")
        return privileged

    @field_validator("pid_mode")
    @classmethod
    def _own_pids(cls, pid_mode: str | None) -> str | None:
        if pid_mode is not None and pid_mode != "":
            raise ValueError(f"pid_mode {pid_mode!r} is refused: a rank sees only its own processes")
        return None

    @field_validator("cap_add")
    @classmethod
    def _allowed_capabilities(cls, cap_add: list[str]) -> list[str]:
        names = [c.removeprefix("CAP_") for c in cap_add]
        refused = sorted(set(names) - CAPABILITIES_ALLOWED)
        if refused:
            raise ValueError(
                f"cap_add refused: {', '.join(refused)} (allowed: {', '.join(sorted(CAPABILITIES_ALLOWED))})"
            )
        return names


HostPath = Annotated[str, Field(min_length=1, max_length=4096)]
ImageName = Annotated[str, Field(min_length=1, max_length=512)]


class ContainerSupport(Wire):
    """What a node lets containerized jobs use, from its agent's settings (`REPRISE_CONTAINER_MOUNT_ROOTS`,
    `REPRISE_CONTAINER_IMAGES`); its node report carries it."""

    mount_roots: list[HostPath] = Field(
        default_factory=list, max_length=ROOTS_MAX, description="host paths a mount source must lie under"
    )
    images: list[ImageName] | None = Field(
        default=None, max_length=IMAGES_MAX, description="the only images allowed; None: any"
    )

    def refusal(
        self, container: ContainerSpec, checkpoints_dir: str | None, *, real: Callable[[str], str] = posixpath.normpath
    ) -> tuple[tuple[str | int, ...], str] | None:
        """Why this node would refuse the job's container: the field (as a path: ``("container", "image")``) and the
        reason; None when it runs it. `real` resolves a host path: the node resolves symlinks, the orchestrator, away
        from the node's file system, takes the path as written."""
        if self.images is not None and container.image not in self.images:
            return ("container", "image"), f"{container.image!r} is not on the node's image allow-list"
        sources: list[tuple[tuple[str | int, ...], str]] = [
            (("container", "mounts", n, "source"), m.source) for n, m in enumerate(container.mounts)
        ]
        if checkpoints_dir is not None:
            sources.append((("checkpoints", "directory"), checkpoints_dir))
        roots = [real(root) for root in self.mount_roots]
        for field, source in sources:
            path = real(source)
            why = mount_refusal(path)
            if why is None and not any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots):
                why = f"{path} is outside the node's mount roots ({', '.join(roots) or 'none'})"
            if why is not None:
                return field, why
        return None


def field_name(field: tuple[str | int, ...]) -> str:
    """A refused field as a message names it: ``container.mounts[2].source``."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in field).lstrip(".")
