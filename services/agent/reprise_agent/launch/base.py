"""The interface every rank launcher implements: start a rank, and the handle its supervisor drives it through."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence, Set
from typing import Any, Protocol

from reprise_common.events import ContainerSupport, LaunchArgs, StandbyStatus
from reprise_common.procs import ProcessSample


class RankHandle(Protocol):
    """One launched rank: its exit, its signals, what it uses. Signals reach all of it (every process it started), and
    never a stranger that took its pid since."""

    @property
    def pid(self) -> int:
        """Its main process as this node sees it: reports show it, py-spy reads it, its SDK inbox is named by it."""
        ...

    @property
    def warm(self) -> bool:
        """Whether it started on an interpreter started ahead of need (a standby)."""
        ...

    @property
    def output(self) -> asyncio.StreamReader:
        """Its stdout and stderr, interleaved."""
        ...

    @property
    def returncode(self) -> int | None:
        """Its exit code once it exited (negative: the signal that killed it); None while it runs."""
        ...

    async def wait(self) -> int:
        """Wait for its exit; the code as `returncode` gives it."""
        ...

    def signal(self, sig: int) -> None:
        """Send it a signal, as a fault would."""
        ...

    def terminate(self) -> None:
        """Ask it to stop: SIGTERM, and SIGCONT so that a frozen (SIGSTOPped) rank runs to handle it."""
        ...

    def kill(self) -> None:
        """SIGKILL all of it, also once its main process exited: nothing it started may survive it."""
        ...

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer ended it (asked after its exit)."""
        ...

    def usage(self) -> ProcessSample | None:
        """Its scheduler state and CPU seconds now; None once it is gone or cannot be read."""
        ...

    def io_bytes(self) -> int | None:
        """The bytes it read and wrote through system calls so far; None when they cannot be read."""
        ...

    def rank_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """The environment of an order to restart in place (`env`, the host's view) as the rank must see it: a
        container's differs in its paths and device numbers."""
        ...

    def record(self) -> dict[str, Any]:
        """What a later process of this agent needs to find it again (JSON), should this one die."""
        ...


class Launcher(Protocol):
    """Starts ranks on this node."""

    async def start(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: str | None, warm: bool) -> RankHandle:
        """Start a rank: `env` is what it finds on top of the launcher's own environment; `warm` lets it start on a
        standby where one is ready and fits."""
        ...

    def kill_lost(self, record: Mapping[str, Any]) -> None:
        """Kill what is left of a rank an earlier process of this agent started (its handle's `record`)."""
        ...


class ImageLaunchers(Protocol):
    """Launchers for the jobs whose ranks run in a container image (launch/containers.py)."""

    def for_job(self, spec: LaunchArgs) -> Launcher:
        """A launcher for the job's ranks; raises when this node refuses its container spec or lacks its image."""
        ...

    def kill_lost(self, record: Mapping[str, Any]) -> None:
        """Remove what is left of a containerized rank an earlier process of this agent started."""
        ...

    def adopt(self, record: Mapping[str, Any]) -> RankHandle | None:
        """Supervise on a containerized rank an earlier process of this agent started, when it still runs; None when
        it does not (it is then to be removed with `kill_lost`)."""
        ...

    def prepare_standbys(self, spec: LaunchArgs, env: Mapping[str, str], *, hold_s: float) -> int:
        """Keep standbys of the job ready before any rank of it starts here (a spare), for `hold_s`; how many."""
        ...

    def drop_standbys(self, job_id: str) -> None:
        """Remove the job's prepared standbys."""
        ...

    def support(self) -> ContainerSupport:
        """What containerized jobs may use here (this node's mount roots and image allow-list), as its reports say."""
        ...

    def standby_statuses(self) -> list[StandbyStatus]:
        """Every standby waiting here, as the node report lists them."""
        ...

    def close(self) -> None:
        """Remove what waits for ranks (standbys); close the connections (the agent stops)."""
        ...

    def remove_strays(self, node_id: str, keep: Set[str] = frozenset()) -> list[str]:
        """Remove what is labelled with this node but not adopted (`keep`: ids), left after the ledger's ranks were
        removed; what went."""
        ...
