"""The verifying step on the signals a job gives: ranks that exit 0 finish the job (never a failed attempt), a job
that reports no steps passes once every rank stayed alive and working through the settle time, and a job that uses
the SDK keeps the stricter check (every rank past the restored step).

The step runs as the orchestrator runs it (RecoverySteps.verify) against a real inventory and SQLite; the agents'
node reports are fed to the inventory as they arrive from NATS (Inventory.observe), one every 50 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session

from reprise_common.clock import SystemClock
from reprise_common.db import make_engine
from reprise_common.events import NodeReport, RankAssignment, RankStatus
from reprise_orchestrator import schema
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.inventory import Inventory
from reprise_orchestrator.jobs import service as jobs
from reprise_orchestrator.jobs.models import JobCreate
from reprise_orchestrator.locks import LockHandle
from reprise_orchestrator.recoveries.flows import RecoveryFlow
from reprise_orchestrator.recoveries.records import Baseline, Then, Verified, VerifyPath
from reprise_orchestrator.recoveries.run import RecoveryRun
from reprise_orchestrator.recoveries.service import Current
from reprise_orchestrator.recoveries.states import Outcome, RecoveryStep
from reprise_orchestrator.recoveries.steps import RecoverySteps, StepResult

from . import incidents

EPOCH = 1
NODES = ("n-0", "n-1")  # rank r runs on NODES[r]
POLICY = {"verify_settle_s": 1.0, "verify_timeout_s": 2.5}
Ranks = Callable[[float], list[RankStatus]]  # seconds since the verifying step began → what the agents report


@pytest.fixture
def engine(sqlite_url: str) -> Iterator[Engine]:
    found = make_engine(sqlite_url)
    schema.upgrade(found)
    yield found
    found.dispose()


def rank(r: int, t: float, **fields: Any) -> RankStatus:
    """Rank `r` of the new epoch `t` s in: alive, running, using half a CPU, unless `fields` say otherwise."""
    values: dict[str, Any] = {"proc_state": "R", "cpu_s": 2.0 + 0.5 * t} | fields
    return RankStatus(job_id="job-1", rank=r, restart_epoch=EPOCH, pid=100 + r, **values)


def exits(r: int, t: float, *, at: float, code: int) -> RankStatus:
    """Rank `r`, which exits with `code` `at` s in."""
    return rank(r, t) if t < at else rank(r, t, alive=False, exit_code=code, proc_state="", cpu_s=None)


@dataclass(frozen=True)
class Verifying:
    """A verifying step with its result and how long it took."""

    result: StepResult
    took_s: float

    @property
    def data(self) -> Verified:
        assert isinstance(self.result.data, Verified)
        return self.result.data


def deps_of(engine: Engine, inventory: Inventory | None = None) -> Deps:
    """What the verifying step uses (SQL for the incident's news, the inventory, the clock); nothing else is called."""
    clock = SystemClock()
    nothing = cast(Any, None)
    return Deps(
        settings=nothing,
        engine=engine,
        bus=nothing,
        locks=nothing,
        compute=nothing,
        inventory=inventory or Inventory(clock=clock, stale_s=30),
        registry=nothing,
        clock=clock,
    )


async def _verify(
    engine: Engine, ranks: Ranks, policy: dict[str, Any], baseline: Baseline, every_s: float
) -> Verifying:
    deps = deps_of(engine)
    inventory = deps.inventory
    placement = [RankAssignment(rank=r, node_id=node, gpu=0, local_rank=0) for r, node in enumerate(NODES)]
    with Session(engine) as session:
        spec = JobCreate(name="plain", node_count=2, command=["python", "train.py"], policy=policy)
        job = jobs.create(session, spec=spec, placement=placement)
    job.restart_epoch = EPOCH
    run = RecoveryRun(
        LockHandle(job.id, "token", 1), "rec-1", job, incidents.incident(job_id=job.id), baseline, ranks=placement
    )
    started = time.monotonic()

    async def report() -> None:
        while True:
            statuses = ranks(time.monotonic() - started)
            for r, node in enumerate(NODES):
                mine = [s.model_copy(update={"job_id": job.id}) for s in statuses if s.rank == r]
                inventory.observe(
                    node, NodeReport(source="agent", node_id=node, interval_s=1, gpu_backend="sim", ranks=mine)
                )
            await asyncio.sleep(every_s)

    feeder = asyncio.create_task(report())
    try:
        result = await asyncio.wait_for(RecoverySteps(deps).verify(run), timeout=20)
    finally:
        feeder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feeder
    return Verifying(result, time.monotonic() - started)


def verify(engine: Engine, ranks: Ranks, *, sdk_seen: bool = False, every_s: float = 0.05, **policy: Any) -> Verifying:
    """Run the verifying step of a 2-rank job while the agents report `ranks`, every `every_s`."""
    return asyncio.run(_verify(engine, ranks, POLICY | policy, Baseline(sdk_seen=sdk_seen), every_s))


def test_every_rank_exiting_0_while_verifying_is_a_finished_job_not_a_failed_attempt(engine: Engine) -> None:
    done = verify(engine, lambda t: [exits(0, t, at=0.3, code=0), exits(1, t, at=0.6, code=0)])
    assert done.result.then is Then.NEXT, done.result.detail
    assert done.data.path is VerifyPath.COMPLETED and done.data.finished == [0, 1] and not done.data.dead_ranks
    assert done.took_s < 1.0  # before the settle time: nothing to wait for once training ended


def test_ranks_exiting_0_finish_a_job_that_uses_the_sdk_too(engine: Engine) -> None:
    done = verify(engine, lambda t: [exits(r, t, at=0.2, code=0) for r in (0, 1)], sdk_seen=True)
    assert done.result.then is Then.NEXT and done.data.path is VerifyPath.COMPLETED


def test_a_job_without_steps_is_verified_alive_past_the_settle_time_with_cpu_as_evidence(engine: Engine) -> None:
    done = verify(engine, lambda t: [rank(0, t), rank(1, t)])
    assert done.result.then is Then.NEXT, done.result.detail
    assert done.data.path is VerifyPath.SETTLED and done.data.settle_s == 1.0
    assert set(done.data.cpu_s) == {"0", "1"} and all(used and used >= 0.2 for used in done.data.cpu_s.values())
    assert 1.0 <= done.took_s < 2.0


def test_a_rank_sleeping_between_small_collectives_is_verified_by_its_io_not_its_cpu(engine: Engine) -> None:
    """Measured on tests/stepless_job.py (a 0.2 s sleep a step): 1.3-1.6 % of a core, under the 2 % share, while its
    gloo socket moves; a rank blocked in a collective or in Python used 0.25-0.45 % and moved no byte."""
    sleeper = {"cpu_s": None, "proc_state": "S"}
    done = verify(
        engine,
        lambda t: [
            rank(0, t, **sleeper | {"cpu_s": 2.0 + 0.013 * t, "io_bytes": 24_000_000 + int(40_000 * t)}),
            rank(1, t, **sleeper | {"cpu_s": 2.0 + 0.016 * t, "io_bytes": 24_000_000 + int(40_000 * t)}),
        ],
    )
    assert done.result.then is Then.NEXT and done.data.path is VerifyPath.SETTLED, done.result.detail
    assert all(moved and moved > 0 for moved in done.data.io_bytes.values()), done.data
    still = verify(
        engine, lambda t: [rank(0, t), rank(1, t, proc_state="S", cpu_s=2.0 + 0.004 * t, io_bytes=24_000_000)]
    )
    assert still.result.then is Then.RETRY and still.data.missing == [1], still.data  # neither CPU nor I/O: idle


def test_reports_rarer_than_half_the_settle_time_are_waited_for_not_taken_as_idle(engine: Engine) -> None:
    done = verify(engine, lambda t: [rank(0, t), rank(1, t)], every_s=0.8, verify_settle_s=1.0, verify_timeout_s=5)
    assert done.result.then is Then.NEXT and done.data.path is VerifyPath.SETTLED, done.result.detail


@pytest.mark.parametrize(
    ("why", "rank_1"),
    [
        ("stopped", lambda t: rank(1, t, proc_state="T", cpu_s=2.0)),  # SIGSTOPped: alive, no CPU
        ("idle", lambda t: rank(1, t, proc_state="S", cpu_s=2.0)),  # alive, asleep: never got past its rendezvous
        ("absent", None),  # never reported by its node
    ],
)
def test_a_rank_stopped_idle_or_absent_is_never_settled(
    engine: Engine, why: str, rank_1: Callable[[float], RankStatus] | None
) -> None:
    done = verify(engine, lambda t: [rank(0, t), *([rank_1(t)] if rank_1 else [])])
    assert done.result.then is Then.RETRY and done.data.path is None, why
    assert done.data.missing == [1], done.data
    assert "not alive and working for 1 s in a row within 2.5 s" in done.result.detail


def test_a_job_seen_using_the_sdk_keeps_the_step_check(engine: Engine) -> None:
    done = verify(engine, lambda t: [rank(0, t), rank(1, t)], sdk_seen=True)  # alive, working, but no steps
    assert done.result.then is Then.RETRY and done.data.path is None
    assert "did not pass step 0 within 2.5 s" in done.result.detail


def test_steps_in_the_new_epoch_make_it_a_step_check(engine: Engine) -> None:
    done = verify(engine, lambda t: [rank(0, t, step=5), rank(1, t, step=None if t < 0.3 else 4)])
    assert done.result.then is Then.NEXT and done.data.path is VerifyPath.STEPS
    assert done.data.steps == {"0": 5, "1": 4} and done.took_s < 1.0


def test_where_the_ranks_took_their_state_from_is_kept_with_the_steps(engine: Engine) -> None:
    said = {"resumed_via": "peer", "resumed_step": 4, "resumed_why": "state of step 4 from rank 1"}
    done = verify(engine, lambda t: [rank(0, t, step=5, **said), rank(1, t, step=5, **said)])
    assert done.data.path is VerifyPath.STEPS and done.data.resumed is not None
    assert (done.data.resumed.via, done.data.resumed.step) == ("peer", 4)
    quiet = verify(engine, lambda t: [rank(0, t, step=5), rank(1, t, step=5)])
    assert quiet.data.path is VerifyPath.STEPS and quiet.data.resumed is None


def test_the_policy_can_ask_for_settle_even_when_ranks_report_steps(engine: Engine) -> None:
    done = verify(engine, lambda t: [rank(0, t, step=1), rank(1, t, step=1)], sdk_seen=True, verify_by="settle")
    assert done.result.then is Then.NEXT and done.data.path is VerifyPath.SETTLED


def test_a_rank_exiting_other_than_0_fails_the_attempt_even_after_another_finished(engine: Engine) -> None:
    done = verify(engine, lambda t: [exits(0, t, at=0.2, code=0), exits(1, t, at=0.4, code=1)])
    assert done.result.then is Then.RETRY and done.data.dead_ranks == [1] and done.data.finished == [0]
    assert done.data.load_failed is None  # without steps no one can tell a failed load: the checkpoint is not blamed


def test_a_finished_job_ends_its_recovery_recovered_whatever_the_incident_learned(engine: Engine) -> None:
    flow = RecoveryFlow(deps_of(engine))
    with Session(engine) as session:
        job = jobs.create(session, spec=JobCreate(name="j", node_count=1, command=["true"]), placement=[])
    run = RecoveryRun(LockHandle(job.id, "t", 1), "rec-1", job, incidents.incident(job_id=job.id), Baseline())
    run.step = RecoveryStep.VERIFYING
    news = incidents.gpu_fault(node_id="n-1", rank=1)  # a deeper cause, a culprit node: news
    current = Current(step=RecoveryStep.VERIFYING, attempt=1, ended_at=None, learned=news)
    for path, ends in ((VerifyPath.COMPLETED, True), (VerifyPath.SETTLED, False)):
        result = StepResult(Verified(path=path))
        proposal = flow._next(run, result, current)
        if ends:  # no relaunch of a finished job, even for a new culprit
            assert (proposal.to_step, proposal.outcome) == (RecoveryStep.RUNNING, Outcome.RECOVERED)
            assert "every rank exited 0" in proposal.detail
        else:  # a job that still trains answers the news with a new attempt, as before
            assert (proposal.to_step, proposal.to_attempt) == (RecoveryStep.STOPPING_RANKS, 2)
