"""A list, then a watch from the list's resourceVersion, kept going: the one way the backend follows objects (its
nodes, the jobs' pods) on the API server.

The first list is the baseline. A watch the server ends (its timeout) goes on from the last version seen; one whose
version is older than the server keeps (410 Gone: etcd compacted it) lists every object again and compares against
the last state seen, so a change made while it was away is handed on once, none twice, none lost. What a change
means (a signal, or nothing) is the subclass's: `seen` for an object added or changed, `gone` for one deleted.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from reprise_common.logging import get_logger
from reprise_orchestrator.compute.backend import SignalSink
from reprise_orchestrator.compute.kubernetes.api import KubeError, KubeExpiredError, KubeUnavailableError, WatchEvent

log = get_logger("reprise.orchestrator.compute.kubernetes")


class ListWatch(ABC):
    """The objects of one list-and-watch as last seen (by name), and the version the watch goes on from."""

    resource = "objects"  # what is watched, for logs and errors

    def __init__(self, *, watch_timeout_s: int = 60, retry_s: float = 1.0) -> None:
        self.watch_timeout_s = watch_timeout_s
        self.retry_s = retry_s
        self.objects: dict[str, Any] = {}
        self.resource_version: str | None = None  # None until the first list
        self.lists = 0  # how many lists were taken: the first, and one after each expired watch

    @abstractmethod
    async def list(self) -> tuple[list[Any], str | None]:
        """Every object, and the list's resourceVersion."""

    @abstractmethod
    def stream(self, resource_version: str) -> AsyncIterator[WatchEvent]:
        """The changes after `resource_version`, until the server ends the watch."""

    @abstractmethod
    async def seen(self, name: str, before: Any | None, after: Any, emit: SignalSink) -> None:
        """An object added or changed (`before`: as last seen, None when new; during the first list, the baseline,
        `resource_version` is still None)."""

    @abstractmethod
    async def gone(self, name: str, before: Any, emit: SignalSink) -> None:
        """An object deleted (seen by the watch, or missing from a list)."""

    async def run(self, emit: SignalSink) -> None:
        """List and watch until cancelled; a server that does not answer is tried again after `retry_s`, one that
        refuses (403: the identity lacks `list` or `watch`) after ten times that, each logged."""
        while True:
            try:
                await self.watch_once(emit)
            except KubeUnavailableError as exc:
                log.warning(f"Kubernetes {self.resource} not watched", extra={"error": str(exc)})
                await asyncio.sleep(self.retry_s)
            except KubeError as exc:  # forbidden, or refused: a person must act; tried again, less often
                log.error(f"Kubernetes {self.resource} not watched: refused", extra={"error": str(exc)})
                await asyncio.sleep(self.retry_s * 10)

    async def watch_once(self, emit: SignalSink) -> None:
        """One watch, until the server ends it (after listing first when there is no version to go on from)."""
        if self.resource_version is None:
            await self.relist(emit)
        assert self.resource_version is not None
        try:
            async for event in self.stream(self.resource_version):
                await self._apply(event, emit)
        except KubeExpiredError as exc:
            log.info(f"Kubernetes {self.resource} watch expired: listing again", extra={"error": str(exc)})
            await self.relist(emit)

    async def relist(self, emit: SignalSink) -> None:
        """List every object; what changed since the last state seen is handed on (on the first list, as new)."""
        items, version = await self.list()
        self.lists += 1
        listed = {item.metadata.name: item for item in items if item.metadata and item.metadata.name}
        for name in set(self.objects) - set(listed):
            await self.gone(name, self.objects.pop(name), emit)
        for name, item in listed.items():
            await self.seen(name, self.objects.get(name), item, emit)
            self.objects[name] = item
        if not version:
            raise KubeError(
                f"a list of {self.resource} came without a resourceVersion", verb="list", resource=self.resource
            )
        self.resource_version = version

    async def _apply(self, event: WatchEvent, emit: SignalSink) -> None:
        item = event.object
        if item is not None and item.metadata is not None and item.metadata.name:
            name = item.metadata.name
            if event.type == "DELETED":
                await self.gone(name, self.objects.pop(name, item), emit)
            elif event.type in ("ADDED", "MODIFIED"):
                await self.seen(name, self.objects.get(name), item, emit)
                self.objects[name] = item
        if event.resource_version:
            self.resource_version = event.resource_version
