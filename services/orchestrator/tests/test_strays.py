"""Strays: the ranks of a superseded launch on a node that comes back are stopped with the job's fence, and a stop
that did not reach the node (it was still cut off while its last report looked fresh) is sent again as soon as the
node reports, not a resend period later."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import cast

from sqlmodel import Session, create_engine

from reprise_common.clock import ManualClock
from reprise_common.errors import NoRespondersError
from reprise_common.events import CommandResult, GpuStatus, NodeReport, RankAssignment, RankStatus, StopReply
from reprise_orchestrator import schema
from reprise_orchestrator.compute.backend import Answers, NodeAnswer
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.inventory import Inventory
from reprise_orchestrator.jobs import service
from reprise_orchestrator.jobs.models import JobCreate, JobState
from reprise_orchestrator.jobs.strays import RESEND_S, Strays


class Compute:
    """Answers each stop as the node it goes to would: no responder while the node is cut off."""

    def __init__(self) -> None:
        self.cut: set[str] = set()
        self.stops: list[tuple[list[str], int]] = []  # (nodes, fence)

    async def stop(self, job_id: str, node_ids: Sequence[str], *, operation_id: str, fence: int) -> Answers[StopReply]:
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


def _report(node: str, epoch: int) -> NodeReport:
    rank = RankStatus(job_id="job-a", rank=1, restart_epoch=epoch, step=5, alive=True)
    return NodeReport(
        source=node, node_id=node, interval_s=1.0, gpu_backend="sim", gpus=[GpuStatus(index=0)], ranks=[rank]
    )


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_stop_that_found_the_node_cut_off_is_sent_again_when_the_node_reports(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = ManualClock()
        engine = create_engine(f"sqlite:///{tmp_path / 'o.db'}")
        schema.upgrade(engine)
        with Session(engine) as session:  # job-a recovered onto node-1 and the spare, at epoch 1 under fence 7
            spec = JobCreate(name="j", nodes=["node-1", "spare-1"], command=["true"])
            placement = [
                RankAssignment(rank=i, node_id=n, gpu=0, local_rank=0) for i, n in enumerate(["node-1", "spare-1"])
            ]
            job = service.create(session, spec=spec, placement=placement)
            job.id, job.state, job.restart_epoch, job.max_fence = "job-a", JobState.RUNNING, 1, 7
            session.add(job)
            session.commit()
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
