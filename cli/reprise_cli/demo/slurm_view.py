"""What Slurm shows of the demo's nodes while it runs, read in the background (`sinfo`), so the narration can say when
Slurm saw what Reprise had already handled: a drain with the incident in its reason, a lost node not responding, then
down."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from reprise_cli.slurm import SlurmCluster
from reprise_common.clock import utcnow


@dataclass(frozen=True)
class Sighting:
    """A node's state and reason as `sinfo -N` printed them, first seen at `at`."""

    node: str
    state: str  # e.g. allocated, draining, drained, idle*, down* (* : not responding)
    reason: str
    at: datetime


class SlurmView:
    """Polls the cluster's nodes every `interval_s` and keeps each change of a node's state or reason."""

    def __init__(self, cluster: SlurmCluster, *, interval_s: float = 0.5) -> None:
        self.cluster = cluster
        self.interval_s = interval_s
        self._sightings: list[Sighting] = []
        self._last: dict[str, tuple[str, str]] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-slurm-view", daemon=True)

    def start(self) -> None:
        """Start polling."""
        self._thread.start()

    def stop(self) -> None:
        """Stop polling and wait for the thread."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)

    def _run(self) -> None:
        while not self._stopping.is_set():
            at = utcnow()
            for node, seen in self.cluster.node_view().items():
                if self._last.get(node) != seen:
                    self._last[node] = seen
                    with self._lock:
                        self._sightings.append(Sighting(node, seen[0], seen[1], at))
            self._stopping.wait(self.interval_s)

    def first(self, node: str, matches: Callable[[Sighting], bool], *, after: datetime) -> Sighting | None:
        """The first sighting of `node` at or after `after` that `matches`."""
        with self._lock:
            return next((s for s in self._sightings if s.node == node and s.at >= after and matches(s)), None)

    def wait_for(
        self, node: str, matches: Callable[[Sighting], bool], *, after: datetime, timeout_s: float
    ) -> Sighting | None:
        """Like `first`, waiting up to `timeout_s` for it."""
        deadline = time.monotonic() + timeout_s
        while (found := self.first(node, matches, after=after)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return found


def drained(sighting: Sighting) -> bool:
    """Slurm will not schedule on it: drained, or draining while its job runs."""
    return "drain" in sighting.state


def not_responding(sighting: Sighting) -> bool:
    """Slurm's controller no longer hears the node's slurmd (sinfo marks the state with *)."""
    return sighting.state.endswith("*")


def down(sighting: Sighting) -> bool:
    """Slurm set the node down."""
    return sighting.state.startswith("down")
