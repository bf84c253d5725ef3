"""Strays: the ranks of a superseded launch on a node that comes back are stopped with the job's fence, and a stop
that did not reach the node (it was still cut off while its last report looked fresh) is sent again as soon as the
node reports, not a resend period later."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from sqlalchemy import Engine
from sqlmodel import Session, create_engine

from reprise_cli.servers import NatsServer
from reprise_common import subjects
from reprise_common.aio import poll_until
from reprise_common.bus import Bus
from reprise_common.clock import ManualClock, utcnow
from reprise_common.errors import NoRespondersError
from reprise_common.events import (
    Category,
    CommandResult,
    Culprit,
    GpuStatus,
    NodeReport,
    RankAssignment,
    RankStatus,
    RankStopped,
    RecommendedAction,
    StopCommand,
    StopData,
    StopReply,
    Wire,
    parse_command,
)
from reprise_orchestrator import schema
from reprise_orchestrator.compute.agents.backend import AgentsBackend
from reprise_orchestrator.compute.backend import Answers, NodeAnswer
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.inventory import Inventory
from reprise_orchestrator.jobs import service
from reprise_orchestrator.jobs.models import JobCreate, JobState
from reprise_orchestrator.jobs.strays import RESEND_S, Strays
from reprise_orchestrator.recoveries.run import RecoveryRun
from reprise_orchestrator.recoveries.steps import RecoverySteps

from .incidents import incident


class Compute:
    """Answers each stop as the node it goes to would: no responder while the node is cut off."""

    def __init__(self) -> None:
        self.cut: set[str] = set()
        self.stops: list[tuple[list[str], int]] = []  # (nodes, fence)

    async def stop(
        self, job_id: str, node_ids: Sequence[str], *, operation_id: str, fence: int, **_: object
    ) -> Answers[StopReply]:
        self.stops.append((list(node_ids), fence))
        items = [
            NodeAnswer[StopReply](node_id=n, reply=None, error=NoRespondersError(n))
            if n in self.cut
            else NodeAnswer[StopReply](
                node_id=n, reply=StopReply(command_id=operation_id, node_id=n, result=CommandResult.DONE)
            )
            for n in node_ids
        ]
        return Answers(tuple(items))


def _report(node: str, epoch: int, *, ranks: Sequence[int] = (1,), built: datetime | None = None) -> NodeReport:
    alive = [RankStatus(job_id="job-a", rank=rank, restart_epoch=epoch, step=5, alive=True) for rank in ranks]
    return NodeReport(
        source=node, node_id=node, interval_s=1.0, gpu_backend="sim", gpus=[GpuStatus(index=0)], ranks=alive,
        time=built or utcnow(),
    )  # fmt: skip


def _recovered_job(tmp_path: Path, nodes: Sequence[str] = ("node-1", "spare-1")) -> Engine:
    """job-a, recovered onto node-1 and the spare, at epoch 1 under fence 7."""
    engine = create_engine(f"sqlite:///{tmp_path / 'o.db'}")
    schema.upgrade(engine)
    with Session(engine) as session:
        spec = JobCreate(name="j", nodes=list(nodes), command=["true"])
        placement = [RankAssignment(rank=i, node_id=n, gpu=0, local_rank=0) for i, n in enumerate(nodes)]
        job = service.create(session, spec=spec, placement=placement)
        job.id, job.state, job.restart_epoch, job.max_fence = "job-a", JobState.RUNNING, 1, 7
        session.add(job)
        session.commit()
    return engine


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_stop_that_found_the_node_cut_off_is_sent_again_when_the_node_reports(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = ManualClock()
        engine = _recovered_job(tmp_path)
        inventory = Inventory(clock=clock, stale_s=5.0)
        compute = Compute()
        strays = Strays(cast(Deps, SimpleNamespace(inventory=inventory, engine=engine, clock=clock, compute=compute)))

        compute.cut.add("node-2")
        inventory.observe("node-2", _report("node-2", epoch=0))  # its last report before the cut, still fresh
        assert strays.tick() == 1
        await _settle()
        assert compute.stops == [(["node-2"], 7)]

        clock.advance(6.0)  # node-2's report went stale: nothing to stop while it is away
        assert strays.tick() == 0
        clock.advance(6.0)
        compute.cut.clear()  # the link heals well inside the resend period
        inventory.observe("node-2", _report("node-2", epoch=0))
        assert clock.monotonic() < RESEND_S
        assert strays.tick() == 1, "the stop that never reached node-2 waits out the resend period"
        await _settle()
        assert compute.stops == [(["node-2"], 7), (["node-2"], 7)]

        inventory.observe("node-2", _report("node-2", epoch=0))  # the stop reached it: told once a period, no more
        assert strays.tick() == 0

    asyncio.run(scenario())


async def test_a_node_that_answered_the_stop_is_no_stray_on_a_report_built_before_it(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The recovery's stop reached node-2 and the job trains elsewhere before node-2 reports again: its last report,
    built before the stop, still shows the old ranks alive. They ended when the answer says, so no stop goes there
    again (a CI run's walking skeleton counted a third command on its culprit node). A report built before the stop
    but read after the answer (reports and answers travel on different connections) shows them ended too; one built
    after the stop is believed."""
    built = utcnow()
    ended = built + timedelta(seconds=1)
    engine = _recovered_job(tmp_path)
    bus = Bus(url=nats_server.url, service="test-orchestrator", provision=False)
    await bus.connect(attempts=5)
    fences: list[int] = []

    async def agent(data: bytes) -> Wire:
        command = parse_command(data)
        assert isinstance(command, StopCommand)
        fences.append(command.fence)
        stopped = StopData(stopped=[RankStopped(rank=1, exit_code=0)], ended_at=ended)
        return StopReply(command_id=command.command_id, node_id="node-2", result=CommandResult.DONE, data=stopped)

    clock = ManualClock()
    inventory = Inventory(clock=clock, stale_s=5.0)
    backend = AgentsBackend(bus=bus, inventory=inventory, command_timeout_s=5.0, stop_grace_s=0.5)
    strays = Strays(cast(Deps, SimpleNamespace(inventory=inventory, engine=engine, clock=clock, compute=backend)))
    try:
        await bus.serve(subjects.node_command("node-2"), agent)
        inventory.observe("node-2", _report("node-2", epoch=0, built=built))
        answers = await backend.stop("job-a", ["node-2"], operation_id="rec-1", fence=7)  # the recovery's
        assert answers.all_done
        assert strays.tick() == 0, "node-2's report from before the stop made its ended ranks strays"

        inventory.observe("node-2", _report("node-2", epoch=0, built=built + timedelta(seconds=0.5)))
        assert strays.tick() == 0, "a report built before the stop but read after its answer"

        inventory.observe("node-2", _report("node-2", epoch=0, built=ended + timedelta(seconds=0.1)))
        assert strays.tick() == 1, "a report built after the stop that shows the ranks alive is believed"
        assert await poll_until(lambda: fences == [7, 7], timeout_s=10), fences
    finally:
        await bus.close()


def test_ranks_a_stop_parked_stay_alive_until_the_nodes_next_report() -> None:
    """A restart in place parks ranks instead of stopping them: the stop's answer ends only the others."""
    inventory = Inventory(clock=ManualClock(), stale_s=5.0)
    built = utcnow()
    inventory.observe("node-2", _report("node-2", epoch=0, ranks=(1, 2), built=built))
    inventory.stopped("node-2", "job-a", ended=built + timedelta(seconds=1), parked={2})
    assert set(inventory.ranks_of("job-a", restart_epoch=0)) == {2}
    inventory.observe("node-2", _report("node-2", epoch=0, ranks=(1, 2), built=built + timedelta(seconds=2)))
    assert set(inventory.ranks_of("job-a", restart_epoch=0)) == {1, 2}, "a report built after the stop is believed"


async def test_a_stray_stop_that_found_no_agent_waits_for_the_nodes_next_report(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """No agent answers on node-2 while its last report still looks fresh: the stop is not sent again at every pass
    until that report goes stale, but once node-2 reports again."""
    bus = Bus(url=nats_server.url, service="test-orchestrator", provision=False)
    await bus.connect(attempts=5)
    clock = ManualClock()
    inventory = Inventory(clock=clock, stale_s=5.0)
    backend = AgentsBackend(bus=bus, inventory=inventory, command_timeout_s=2.0, stop_grace_s=0.1)
    strays = Strays(
        cast(Deps, SimpleNamespace(inventory=inventory, engine=_recovered_job(tmp_path), clock=clock, compute=backend))
    )
    try:
        inventory.observe("node-2", _report("node-2", epoch=0))
        assert strays.tick() == 1
        assert await poll_until(lambda: "node-2" not in inventory.placeable(), timeout_s=10)  # no responder
        clock.advance(1.0)
        assert strays.tick() == 0, "a stop sent again at every pass to a node where no agent answers"
        clock.advance(1.0)
        inventory.observe("node-2", _report("node-2", epoch=0))
        assert strays.tick() == 1
    finally:
        await bus.close()


def test_a_recovery_from_a_lost_node_offers_it_to_nothing_until_it_reports_again(tmp_path: Path) -> None:
    """The incident called node-2 lost: its last report may look fresh for seconds yet, but no placement, no spare's
    standby containers and no stray stop takes it for a live node until it reports again (a containerized job's
    recovery told the lost spare, not the next one, to keep its standbys)."""

    async def scenario() -> None:
        clock = ManualClock()
        inventory = Inventory(clock=clock, stale_s=5.0)
        for node in ("node-1", "node-2"):
            inventory.observe(node, _report(node, epoch=0))
        compute = Compute()
        steps = RecoverySteps(cast(Deps, SimpleNamespace(inventory=inventory, compute=compute, clock=clock)))
        with Session(_recovered_job(tmp_path, nodes=("node-1", "node-2")), expire_on_commit=False) as session:
            job = service.get(session, job_id="job-a")
        lost = incident(
            job_id="job-a", category=Category.NODE, root_cause="node-2 lost", culprit=Culprit(node_id="node-2"),
            recommended_action=RecommendedAction.RESTART_EXCLUDE_NODE,
        )  # fmt: skip
        handle: Any = SimpleNamespace(fence=7)  # what stop_ranks reads of the lock
        run = RecoveryRun(handle=handle, recovery_id="rec-1", job=job, incident=lost, baseline=cast(Any, None))
        await steps.stop_ranks(run)
        assert compute.stops == [(["node-1"], 7)]  # nothing answers on node-2: not waited for
        assert inventory.placeable() == ["node-1"]
        assert set(inventory.live_launches()[("job-a", 0)]) == {"node-1"}
        clock.advance(1.0)
        inventory.observe("node-2", _report("node-2", epoch=0))  # it was cut off, not gone: it is back
        assert inventory.placeable() == ["node-1", "node-2"]

    asyncio.run(scenario())
