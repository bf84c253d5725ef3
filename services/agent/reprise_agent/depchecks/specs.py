"""What operators configure in REPRISE_DEPENDENCY_CHECKS: one spec model per kind of check, picked by its "kind"."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, HttpUrl, TypeAdapter, model_validator


class _CheckSpec(BaseModel):
    """Fields every check shares; an empty ``name`` is derived from what is checked, e.g. ``storage:/ckpt``."""

    # Operators write these by hand in REPRISE_DEPENDENCY_CHECKS: refuse a misspelt field instead of ignoring it.
    model_config = ConfigDict(extra="forbid")
    _target: ClassVar[str]  # what is checked, formatted from the fields
    _deadline_field: ClassVar[str] = "timeout_s"

    kind: str
    name: str = Field(default="", max_length=256, description="dependency name in events; derived when empty")

    @model_validator(mode="after")
    def _derive_name(self) -> _CheckSpec:
        if not self.name:
            self.name = f"{self.kind}:{self.target()}"
        return self

    def target(self) -> str:
        """What is checked: a path, ``host:port`` or a URL."""
        return self._target.format_map(self.__dict__)

    def deadline_s(self) -> float:
        """How long one whole run of this check may take before it counts as failed."""
        return float(getattr(self, self._deadline_field))


class StorageCheck(_CheckSpec):
    """The path is writable and responsive: write, fsync, read back and delete a small probe file."""

    _target = "{path}"
    _deadline_field = "max_write_latency_s"

    kind: Literal["storage"] = "storage"
    path: Path
    max_write_latency_s: float = Field(default=2.0, gt=0)


class DiskCheck(_CheckSpec):
    """The filesystem holding ``path`` has at least ``min_free_bytes`` and/or ``min_free_fraction`` free."""

    _target = "{path}"

    kind: Literal["disk"] = "disk"
    path: Path
    min_free_bytes: int | None = Field(default=None, ge=0)
    min_free_fraction: float | None = Field(default=None, gt=0, le=1)
    timeout_s: float = Field(default=2.0, gt=0, description="statvfs on a hung network mount blocks too")

    @model_validator(mode="after")
    def _some_limit(self) -> DiskCheck:
        if self.min_free_bytes is None and self.min_free_fraction is None:
            raise ValueError("a disk check needs min_free_bytes or min_free_fraction (or both)")
        return self


class TcpCheck(_CheckSpec):
    """A TCP connection to ``host:port`` opens within ``timeout_s``."""

    _target = "{host}:{port}"

    kind: Literal["tcp"] = "tcp"
    host: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    timeout_s: float = Field(default=2.0, gt=0)


class HttpCheck(_CheckSpec):
    """A GET on ``url`` answers ``expect_status`` within ``timeout_s`` in total (redirects are not followed)."""

    _target = "{url}"

    kind: Literal["http"] = "http"
    url: HttpUrl
    timeout_s: float = Field(default=2.0, gt=0)
    expect_status: int = Field(default=200, ge=100, le=599)


class DockerCheck(_CheckSpec):
    """The Docker daemon at ``url`` (``unix:///path`` or ``tcp://host:port``) answers its ping within ``timeout_s``;
    an agent that runs container ranks checks its own daemon without being told (docs/containers.md)."""

    _target = "{url}"

    kind: Literal["docker"] = "docker"
    url: str = Field(min_length=1, max_length=4096, pattern=r"^(unix|tcp)://.+")
    timeout_s: float = Field(default=2.0, gt=0, le=60)


DependencyCheckSpec = Annotated[
    StorageCheck | DiskCheck | TcpCheck | HttpCheck | DockerCheck, Field(discriminator="kind")
]


def with_docker(specs: list[DependencyCheckSpec], docker_url: str | None) -> list[DependencyCheckSpec]:
    """The configured checks, plus a check of the agent's own Docker daemon when it has one and none names it."""
    if docker_url is None or any(isinstance(spec, DockerCheck) for spec in specs):
        return specs
    return [*specs, DockerCheck(name="docker", url=docker_url)]


def unique_names(specs: list[DependencyCheckSpec]) -> list[DependencyCheckSpec]:
    """The specs, unless two share a name (ValueError)."""
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"two dependency checks are named {spec.name!r}: give one of them another name")
        seen.add(spec.name)
    return specs


# The settings field type: a JSON list in REPRISE_DEPENDENCY_CHECKS, each item picked by its "kind".
DependencyChecks = Annotated[list[DependencyCheckSpec], AfterValidator(unique_names)]
DEPENDENCY_CHECKS = TypeAdapter(DependencyChecks)
