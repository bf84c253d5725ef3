"""Node conditions become signals, through a real watch on the real API server: a labelled node going NotReady is
one signal (a status written again without a transition, a node of another pool, or any other change is none), and a
watch that expired (410: etcd compacted its resourceVersion while it was away) lists again and reports the change it
missed once, the ones it had seen never again, and goes on watching."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from reprise_cli.kube_server import KubeApiServer
from reprise_common.events import ComputeSignal, ComputeSignalKind, NodeReport
from reprise_orchestrator.compute.kubernetes.api import KubeApi, KubeExpiredError
from reprise_orchestrator.compute.kubernetes.backend import KubernetesBackend

from .cluster import Admin, unique
from .conftest import backend_access, open_backend

POOL_LABEL = "reprise.dev/pool"


async def until(holds: Callable[[], bool], *, timeout_s: float = 20.0) -> None:
    """Wait until `holds()` (asserted)."""
    deadline = time.monotonic() + timeout_s
    while not holds():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


class Watched:
    """The backend's watch running as a task, and the signals it emitted."""

    def __init__(self, backend: KubernetesBackend) -> None:
        self.backend = backend
        self.signals: list[ComputeSignal] = []
        self.task: asyncio.Task[None] | None = None

    async def emit(self, signal: ComputeSignal) -> None:
        self.signals.append(signal)

    async def start(self) -> None:
        self.task = asyncio.create_task(self.backend.watch(self.emit))
        await until(lambda: self.backend.nodes.resource_version is not None)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def seen(self) -> list[tuple[ComputeSignalKind, str | None]]:
        return [(signal.kind, signal.node_id) for signal in self.signals]


@pytest.fixture
async def pool(admin: Admin) -> list[str]:
    """Three Ready nodes labelled for this test alone."""
    label = unique("pool")
    names = [f"{label}-{i}" for i in range(3)]
    for name in names:
        await admin.create_node(name, labels={POOL_LABEL: label})
    return names


@pytest.fixture
async def watched(kube_server: KubeApiServer, pool: list[str], tmp_path: Path) -> AsyncIterator[Watched]:
    """The backend watching the pool's nodes only, as its own identity."""
    label = pool[0].rsplit("-", 1)[0]
    backend = open_backend(KubeApi(backend_access(kube_server)), tmp_path, label_selector=f"{POOL_LABEL}={label}")
    found = Watched(backend)
    await found.start()
    yield found
    await found.stop()
    await backend.close()


async def test_a_node_going_not_ready_is_one_signal(admin: Admin, pool: list[str], watched: Watched) -> None:
    outsider = unique("other-pool")
    await admin.create_node(outsider, labels={POOL_LABEL: "someone-else"})
    await admin.set_condition(outsider, "Ready", "False", reason="KubeletNotReady")

    await admin.set_condition(pool[0], "Ready", "False", reason="KubeletNotReady")
    await until(lambda: len(watched.signals) >= 1)
    await admin.set_condition(pool[0], "Ready", "False", reason="KubeletNotReady")  # written again: no transition
    await admin.add_taint(pool[1], "example.com/other-change")
    await until(lambda: "example.com/other-change" in str(watched.backend.nodes.nodes[pool[1]].spec))

    assert watched.seen() == [(ComputeSignalKind.NODE_DOWN, pool[0])]
    assert "Ready=False: KubeletNotReady" in watched.signals[0].detail
    assert not _ready(watched, pool[0])


def _ready(watched: Watched, name: str) -> bool:
    return watched.backend.nodes.health[name].status("Ready") == "True"


async def test_an_expired_watch_lists_again_and_misses_nothing(
    admin: Admin, kube_server: KubeApiServer, pool: list[str], watched: Watched
) -> None:
    await admin.set_condition(pool[0], "Ready", "False", reason="KubeletNotReady")
    await until(lambda: len(watched.signals) == 1)
    await watched.stop()  # the watch is away (its connection dropped) ...
    stale = watched.backend.nodes.resource_version
    assert stale is not None

    await admin.set_condition(pool[1], "Ready", "Unknown", reason="NodeStatusUnknown")  # ... while a node fails
    kube_server.etcd.compact()  # ... and etcd compacts the history the watch would go on from
    with pytest.raises(KubeExpiredError):
        async for _ in watched.backend.api.watch_nodes(resource_version=stale, timeout_s=5):
            pass
    lists = watched.backend.nodes.lists

    await watched.start()  # goes on from its stale version: 410, lists again
    await until(lambda: len(watched.signals) == 2)
    assert watched.backend.nodes.lists == lists + 1
    await admin.set_condition(pool[2], "Ready", "False", reason="KubeletNotReady")  # and watches again after it
    await until(lambda: len(watched.signals) == 3)
    await asyncio.sleep(0.5)

    assert watched.seen() == [
        (ComputeSignalKind.NODE_DOWN, pool[0]),
        (ComputeSignalKind.NODE_NOT_RESPONDING, pool[1]),
        (ComputeSignalKind.NODE_DOWN, pool[2]),
    ]
    assert len({signal.event_id for signal in watched.signals}) == 3


async def test_the_pool_offers_only_nodes_kubernetes_would_schedule_on(
    admin: Admin, pool: list[str], watched: Watched
) -> None:
    backend = watched.backend
    for name in pool:  # as the agents in the nodes' pods report
        report = NodeReport(source=name, node_id=name, interval_s=1.0, gpu_backend="sim", spare=name == pool[2])
        backend.agents.inventory.observe(name, report)
    assert (set(backend.pool().workers), set(backend.pool().spares)) == ({pool[0], pool[1]}, {pool[2]})

    await admin.cordon(pool[0])  # an admin's cordon
    await admin.set_condition(pool[2], "Ready", "False", reason="KubeletNotReady")
    await until(lambda: (backend.pool().workers, backend.pool().spares) == ([pool[1]], []))
    await backend.cordon(pool[1], reason="incident inc-1: XID 79")
    await until(lambda: backend.pool().workers == [])
    await backend.uncordon(pool[1])
    await until(lambda: backend.pool().workers == [pool[1]])
