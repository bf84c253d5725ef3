"""The job spec's `container` section as a request: the shared ContainerSpec, refusing fields it does not know.

The wire model tolerates unknown fields (an older agent reads a newer launch); a job's submission must not: a
misspelled limit would be dropped in silence. These subclasses only change that; every rule stays the shared one.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field

from reprise_common.events import ContainerMount, ContainerSpec
from reprise_common.events.containers import MOUNTS_MAX


class ContainerMountRequest(ContainerMount):
    """A mount as a job asks for it (unknown fields refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ContainerRequest(ContainerSpec):
    """A job's container section (unknown fields refused, in it and in its mounts)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mounts: list[ContainerMountRequest] = Field(default_factory=list, max_length=MOUNTS_MAX)  # type: ignore[assignment]
