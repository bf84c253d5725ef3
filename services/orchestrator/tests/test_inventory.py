"""The node inventory: the newest report of each node wins, ranks are found by job and launch, stale nodes drop out,
and reports arrive on a NATS connection other than the one that carries commands."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from reprise_cli.client import poll
from reprise_cli.servers import NatsServer
from reprise_common import subjects
from reprise_common.aio import poll_until
from reprise_common.bus import Bus
from reprise_common.clock import ManualClock, SystemClock
from reprise_common.events import GpuHealth, GpuStatus, NodeReport, RankStatus
from reprise_orchestrator.compute.agents.backend import AgentsBackend
from reprise_orchestrator.inventory import Inventory


def _report(node: str, *ranks: RankStatus, spare: bool = False, health: GpuHealth = GpuHealth.OK) -> NodeReport:
    gpus = [GpuStatus(index=0, health=health), GpuStatus(index=1)]
    return NodeReport(
        source=node, node_id=node, interval_s=1.0, gpu_backend="sim", gpus=gpus, ranks=list(ranks), spare=spare
    )


def _rank(job: str, rank: int, epoch: int, *, step: int | None = None, alive: bool = True) -> RankStatus:
    return RankStatus(job_id=job, rank=rank, restart_epoch=epoch, step=step, alive=alive)


def test_ranks_are_found_by_job_and_launch_and_follow_each_nodes_latest_report() -> None:
    clock = ManualClock()
    inventory = Inventory(clock=clock, stale_s=5.0)
    inventory.observe("node-1", _report("node-1", _rank("job-a", 0, 1, step=7), _rank("job-a", 1, 1)))
    inventory.observe("node-2", _report("node-2", _rank("job-a", 2, 1), _rank("job-a", 0, 0, alive=False)))
    inventory.observe("node-3", _report("node-3", _rank("job-b", 0, 4)))

    assert {r: s.step for r, s in inventory.ranks_of("job-a", restart_epoch=1).items()} == {0: 7, 1: None, 2: None}
    assert list(inventory.ranks_of("job-a", restart_epoch=0)) == [0]  # the rank a node still shows from before
    assert inventory.ranks_of("job-b", restart_epoch=1) == {}

    inventory.observe("node-1", _report("node-1", _rank("job-b", 1, 4)))  # node-1 left job-a for job-b
    assert list(inventory.ranks_of("job-a", restart_epoch=1)) == [2]
    assert sorted(inventory.ranks_of("job-b", restart_epoch=4)) == [0, 1]

    clock.advance(4.0)
    inventory.observe("node-3", _report("node-3", _rank("job-b", 0, 4)))
    clock.advance(2.0)  # node-1 and node-2 are stale now, node-3 is not
    assert list(inventory.ranks_of("job-b", restart_epoch=4)) == [0]
    assert inventory.ranks_of("job-a", restart_epoch=1) == {}
    assert inventory.placeable() == ["node-3"]


def test_placeable_nodes_are_fresh_healthy_and_of_the_kind_asked() -> None:
    clock = ManualClock()
    inventory = Inventory(clock=clock, stale_s=5.0)
    inventory.observe("w-2", _report("w-2"))
    inventory.observe("w-1", _report("w-1", health=GpuHealth.DEGRADED))
    inventory.observe("w-bad", _report("w-bad", health=GpuHealth.FAILED))
    inventory.observe("s-1", _report("s-1", spare=True))
    assert inventory.placeable() == ["w-1", "w-2"]
    assert inventory.placeable(exclude={"w-1"}) == ["w-2"]
    assert inventory.placeable(spares=True) == ["s-1"]
    inventory.observe("w-bad", _report("w-bad"))  # its GPU recovered
    assert inventory.placeable() == ["w-1", "w-2", "w-bad"]
    assert (inventory.known(), inventory.gpu_count("w-1"), inventory.gpu_count("nowhere")) == (4, 2, 0)


async def test_reports_followed_on_the_wire_keep_each_nodes_newest_and_skip_a_bad_one(nats_server: NatsServer) -> None:
    inventory = Inventory(clock=SystemClock(), stale_s=30.0)
    await inventory.start(Bus(url=nats_server.url, service="test-inventory", provision=False))
    agents = Bus(url=nats_server.url, service="test-agents", provision=False)
    await agents.connect(attempts=5)

    for epoch in (1, 2, 3):  # the newest of several reports from one node counts
        report = _report("node-1", _rank("job-a", 0, epoch, step=epoch))
        await agents.nc.publish(subjects.node_report("node-1"), report.to_bytes())
    await agents.nc.publish(subjects.node_report("node-2"), _report("node-2", _rank("job-a", 1, 3)).to_bytes())
    await agents.nc.flush()
    assert await poll_until(lambda: len(inventory.ranks_of("job-a", restart_epoch=3)) == 2, timeout_s=10)
    assert inventory.ranks_of("job-a", restart_epoch=3)[0].step == 3
    assert inventory.ranks_of("job-a", restart_epoch=1) == {}

    await agents.nc.publish(subjects.node_report("node-2"), b'{"gpus": "not a list"}')
    await agents.nc.publish(subjects.node_report("node-3"), _report("node-3").to_bytes())
    await agents.nc.flush()
    assert await poll_until(lambda: inventory.known() == 3, timeout_s=10)
    assert list(inventory.ranks_of("job-a", restart_epoch=3)) == [0, 1]  # node-2's last good report still counts
    assert [n.node_id for n in inventory.public({"node-3": "maintenance"}) if n.cordoned] == ["node-3"]
    await agents.close()
    await inventory.stop()


async def test_a_waiter_wakes_when_reports_land_not_at_its_timeout(nats_server: NatsServer) -> None:
    inventory = Inventory(clock=SystemClock(), stale_s=30.0)
    await inventory.start(Bus(url=nats_server.url, service="test-inventory", provision=False))
    agents = Bus(url=nats_server.url, service="test-agents", provision=False)
    await agents.connect(attempts=5)
    assert not await inventory.next_reports(0.05)  # nothing arrived: the wait ends at its timeout, saying so

    waiter = asyncio.create_task(inventory.next_reports(60.0))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await agents.nc.publish(subjects.node_report("node-1"), _report("node-1", _rank("job-a", 0, 1, step=5)).to_bytes())
    assert await asyncio.wait_for(waiter, 10.0)
    assert inventory.ranks_of("job-a", restart_epoch=1)[0].step == 5

    waiter = asyncio.create_task(inventory.next_reports(60.0))
    await asyncio.sleep(0)
    inventory.observe("node-2", _report("node-2"))  # a report recorded directly wakes waiters too
    assert await asyncio.wait_for(waiter, 1.0)
    await agents.close()
    await inventory.stop()


def test_reports_arrive_on_a_connection_of_their_own(nats_server: NatsServer, admin_client: Any) -> None:

    def subscriptions() -> dict[str, list[str]]:
        url = f"http://{nats_server.host}:{nats_server.monitor_port}/connz?subs=1"
        return {
            c.get("name", ""): c.get("subscriptions_list", []) for c in httpx.get(url, timeout=5).json()["connections"]
        }

    with admin_client(nats_server.url) as client:
        assert poll(lambda: client.get("/readyz").status_code, lambda status: status == 200, timeout_s=15) == 200
        by_connection = poll(subscriptions, lambda subs: "orchestrator-reports" in subs, timeout_s=15)
    # A burst of reports can only ever slow down the connection that carries them, not the recovery's commands.
    assert subjects.AGENT_REPORTS in by_connection["orchestrator-reports"]
    assert subjects.AGENT_REPORTS not in by_connection["orchestrator"]


def test_a_node_whose_agent_is_gone_is_not_placeable_until_it_reports_again() -> None:
    clock = ManualClock()
    inventory = Inventory(clock=clock, stale_s=5.0)
    inventory.observe("s-1", _report("s-1", spare=True))
    inventory.observe("s-2", _report("s-2", spare=True))
    clock.advance(0.5)
    inventory.agent_gone("s-1")  # its report is fresh for 4.5 s more, but nothing listens there
    assert inventory.placeable(spares=True) == ["s-2"]
    clock.advance(1.0)
    inventory.observe("s-1", _report("s-1", spare=True))  # its agent is back
    assert inventory.placeable(spares=True) == ["s-1", "s-2"]


def test_a_node_whose_agent_said_it_stops_is_not_placeable_until_an_agent_reports_there_again() -> None:
    """Under a scheduler a job's agents stop with its allocation and the next job's start on the same nodes: a launch
    sent on the old agents' last, still fresh, report found nobody listening and the new job failed (CI, kubernetes)."""
    clock = ManualClock()
    inventory = Inventory(clock=clock, stale_s=5.0)
    inventory.observe("node-1", _report("node-1"))
    inventory.observe("node-2", _report("node-2"))
    clock.advance(0.5)
    inventory.observe("node-1", _report("node-1").model_copy(update={"stopping": True}))
    assert inventory.placeable() == ["node-2"] and inventory.fresh("node-1")
    clock.advance(1.0)
    inventory.observe("node-1", _report("node-1"))  # the next agent there
    assert inventory.placeable() == ["node-1", "node-2"]


async def test_a_stop_that_finds_no_agent_takes_the_node_out_of_the_pool(nats_server: NatsServer) -> None:
    """A node lost a moment ago reported a second before; offered as the next spare, its launch had no responder and
    the recovery retried after its backoff, cold (seen in make bench-recovery: 2.8 s instead of 0.7 s)."""
    inventory = Inventory(clock=SystemClock(), stale_s=30.0)
    inventory.observe("w-1", _report("w-1"))
    inventory.observe("s-1", _report("s-1", spare=True))
    bus = Bus(url=nats_server.url, service="test-orchestrator", provision=False)
    await bus.connect(attempts=5)
    backend = AgentsBackend(bus=bus, inventory=inventory, command_timeout_s=2.0, stop_grace_s=0.5)
    try:
        answers = await backend.stop("job-a", ["s-1"], operation_id="op-1", fence=1)  # no agent subscribes there
        assert answers.gone() == ["s-1"]
        assert backend.pool().spares == []
        assert backend.pool().workers == ["w-1"]
    finally:
        await bus.close()
