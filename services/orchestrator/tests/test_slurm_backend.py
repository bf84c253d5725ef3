"""The slurm compute backend against the real Slurm cluster on this host (the session's, conftest.py): a cordon drains
the node with its reason and an uncordon resumes it, an admin's drain is respected, a lost slurmd and the allocation it
fails are signalled once, a cancel ends the job's allocation only, and a controller that is gone is a clear error
within the timeout (a drain it missed is applied when it is back). The signal rules are also table-tested."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import pytest

from reprise_cli.slurm import SlurmCluster
from reprise_common.bus import Bus
from reprise_common.clock import SystemClock
from reprise_common.errors import ConfigError
from reprise_common.events import ComputeSignal, ComputeSignalKind, NodeReport
from reprise_orchestrator.compute.choose import BackendContext, open_backend
from reprise_orchestrator.compute.slurm.backend import SlurmBackend
from reprise_orchestrator.compute.slurm.cli import SlurmUnavailableError
from reprise_orchestrator.compute.slurm.models import SlurmJob, SlurmJobState, SlurmNode, SlurmSubmission
from reprise_orchestrator.compute.slurm.signals import SlurmView, allocation_name, signals
from reprise_orchestrator.inventory import Inventory
from reprise_orchestrator.settings import OrchestratorSettings

from .slurm_waits import eventually
from .test_slurm_cli import ONE_TASK_PER_NODE, as_admin, sinfo_reasons

WORKERS = ("node1", "node2", "node3", "node4")
SPARE = "node5"
TIMEOUT_S = 4.0
R, P = SlurmJobState.RUNNING, SlurmJobState.PENDING
NOT_RESPONDING, DOWN, NODE_FAIL = (
    ComputeSignalKind.NODE_NOT_RESPONDING,
    ComputeSignalKind.NODE_DOWN,
    ComputeSignalKind.NODE_FAIL,
)


def open_slurm(conf: Path, tmp_path: Path) -> SlurmBackend:
    """The backend REPRISE_COMPUTE_BACKEND=slurm builds, its agents' nodes node1-4 and the spare node5 reporting."""
    chosen = OrchestratorSettings(
        compute_backend="slurm",
        slurm_conf=conf,
        slurm_command_timeout_s=TIMEOUT_S,
        slurm_poll_interval_s=0.3,
        database_url=f"sqlite:///{tmp_path / 'o.db'}",
    )
    inventory = Inventory(clock=SystemClock(), stale_s=3600)
    for node in (*WORKERS, SPARE):  # as the agents srun started in the allocation report
        report = NodeReport(source=node, node_id=node, interval_s=1.0, gpu_backend="sim", spare=node == SPARE)
        inventory.observe(node, report)
    bus = Bus.for_service(chosen, "orchestrator")  # never connected: launch and stop are not exercised here
    backend = open_backend(BackendContext(settings=chosen, bus=bus, inventory=inventory, clock=SystemClock()))
    assert isinstance(backend, SlurmBackend)
    return backend


@pytest.fixture
def backend(slurm_cluster: SlurmCluster, tmp_path: Path) -> SlurmBackend:
    """The slurm backend on the session's cluster."""
    return open_slurm(slurm_cluster.conf_path, tmp_path)


async def running(backend: SlurmBackend, job_id: int) -> SlurmJob:
    """The Slurm job once it runs (asserted)."""
    job = await eventually(
        lambda: backend.cli.job(job_id), lambda j: j is not None and j.state is SlurmJobState.RUNNING
    )
    assert job is not None and job.state is R, job
    return job


async def test_the_setting_builds_a_slurm_backend_offering_what_slurm_schedules(
    backend: SlurmBackend, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    assert (backend.name, backend.cli.conf, backend.cli.timeout_s) == ("slurm", slurm_cluster.conf_path, TIMEOUT_S)
    with pytest.raises(SlurmUnavailableError, match="not read yet"):
        backend.pool()  # nothing known of Slurm before the first read: never a guess
    assert await backend.poll() == []  # the first read is the baseline

    pool = backend.pool(exclude={"node1"})
    assert (pool.workers, pool.spares) == (["node2", "node3", "node4"], ["node5"])
    with pytest.raises(ConfigError, match="REPRISE_SLURM_CONF"):
        open_slurm(tmp_path / "missing.conf", tmp_path)


async def test_a_cordon_drains_the_node_with_its_reason_and_an_uncordon_resumes_it(
    backend: SlurmBackend, slurm_cluster: SlurmCluster
) -> None:
    await backend.cordon("node2", reason="GPU XID 79 (fallen off the bus)\nincident inc-7f3a")

    assert sinfo_reasons(slurm_cluster)["node2"] == "reprise: GPU XID 79 (fallen off the bus) incident inc-7f3a"
    await backend.poll()
    assert backend.pool().workers == ["node1", "node3", "node4"]

    await backend.uncordon("node2")
    await eventually(backend.cli.nodes, lambda nodes: all(n.schedulable for n in nodes))
    assert "node2" not in sinfo_reasons(slurm_cluster)
    await backend.poll()
    assert backend.pool().workers == list(WORKERS)


async def test_a_node_an_admin_drained_is_not_offered_and_keeps_the_admins_drain(
    backend: SlurmBackend, slurm_cluster: SlurmCluster
) -> None:
    as_admin(slurm_cluster, "scontrol", "update", "NodeName=node3", "State=DRAIN", "Reason=admin: DIMM errors, #4411")
    as_admin(slurm_cluster, "scontrol", "update", f"NodeName={SPARE}", "State=DRAIN", "Reason=admin: reserved")
    await backend.poll()

    pool = backend.pool()
    assert (pool.workers, pool.spares) == (["node1", "node2", "node4"], [])
    await backend.cordon("node3", reason="XID 48")
    await backend.uncordon("node3")  # lifts only our own drains
    assert sinfo_reasons(slurm_cluster)["node3"] == "admin: DIMM errors, #4411"
    assert "node3" not in backend.pool().workers


async def test_a_lost_slurmd_and_the_allocation_it_fails_are_each_signalled_once(
    backend: SlurmBackend, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    submission = SlurmSubmission(
        name=allocation_name("job-a"), nodes=2, script=ONE_TASK_PER_NODE, output=tmp_path / "%j.out"
    )
    slurm_id = await backend.cli.submit(submission)
    lost = (await running(backend, slurm_id)).nodes[-1]
    seen: list[ComputeSignal] = []

    async def emit(signal: ComputeSignal) -> None:
        seen.append(signal)

    async def kinds() -> set[ComputeSignalKind]:
        return {signal.kind for signal in seen}

    watch = asyncio.create_task(backend.watch(emit))
    try:
        await asyncio.sleep(1)  # the baseline read, with the job running
        slurm_cluster.kill_node(lost)
        await eventually(kinds, lambda found: {DOWN, NODE_FAIL} <= found, timeout_s=45)
        await asyncio.sleep(1.5)  # more reads of the same states: nothing new
    finally:
        watch.cancel()

    assert Counter((s.kind, s.node_id, s.job_id) for s in seen) == {
        (NOT_RESPONDING, lost, None): 1,
        (DOWN, lost, None): 1,
        (NODE_FAIL, lost, "job-a"): 1,  # requeued by Slurm: the platform's job, and the node that failed
    }
    assert all(s.backend == "slurm" and s.detail for s in seen)
    assert lost not in backend.pool().usable()


async def test_a_job_is_offered_only_the_nodes_of_its_own_allocation(backend: SlurmBackend, tmp_path: Path) -> None:
    """Several jobs, each in its allocation: one job's recovery must never be given another's node, its spare
    included (that spare's agent runs in the other allocation and ends with it)."""
    a, b = [
        await backend.cli.submit(
            SlurmSubmission(name=allocation_name(job), nodes=2, script=ONE_TASK_PER_NODE, output=tmp_path / job)
        )
        for job in ("job-a", "job-b")
    ]
    nodes_a, nodes_b = (await running(backend, a)).nodes, (await running(backend, b)).nodes
    await backend.poll()

    offered = backend.pool(job_id="job-a")
    assert set(offered.usable()) == set(nodes_a) and not set(offered.usable()) & set(nodes_b)
    assert set(backend.pool(job_id="job-b").usable()) == set(nodes_b)
    assert backend.pool(job_id="job-a", exclude={nodes_a[0]}).usable() == {nodes_a[1]}
    assert backend.pool(job_id="job-without-allocation").usable() == set()  # it waits for its allocation
    assert backend.pool().usable() == {*WORKERS, SPARE}  # no job named: every node Slurm schedules on


async def test_a_cancel_ends_the_jobs_allocation_and_nothing_else(backend: SlurmBackend, tmp_path: Path) -> None:
    ours, other = [
        await backend.cli.submit(SlurmSubmission(name=name, nodes=1, script=ONE_TASK_PER_NODE, output=tmp_path / out))
        for name, out in ((allocation_name("job-c"), "c.out"), ("someone else's job", "o.out"))
    ]
    await running(backend, ours)

    assert await backend.cancel("job-c") == [ours]

    job = await eventually(
        lambda: backend.cli.job(ours), lambda j: j is not None and j.state is not SlurmJobState.RUNNING
    )
    assert job is not None and job.state in {SlurmJobState.CANCELLED, SlurmJobState.COMPLETING}
    assert (await running(backend, other)).name == "someone else's job"
    assert await backend.cancel("job-c") == []  # ended: nothing left to cancel
    assert await backend.cancel("job-without-allocation") == []


async def test_a_stopped_controller_is_a_clear_error_within_the_timeout_and_a_missed_drain_follows(
    backend: SlurmBackend, slurm_cluster: SlurmCluster
) -> None:
    await backend.poll()
    slurm_cluster.stop_controller()

    for call in (backend.poll, lambda: backend.cordon("node4", reason="XID 79")):
        started = time.monotonic()
        with pytest.raises(SlurmUnavailableError, match="controller"):
            await call()
        assert time.monotonic() - started < 2 * TIMEOUT_S + 2  # a read and the write, each bounded: never a hang
    with pytest.raises(SlurmUnavailableError, match=r"not known.*controller"):
        backend.pool()  # placement waits for Slurm instead of guessing

    slurm_cluster.start_controller()
    await backend.poll()  # the drain the controller missed is applied first
    assert sinfo_reasons(slurm_cluster)["node4"] == "reprise: XID 79"
    assert backend.pool().workers == ["node1", "node2", "node3"]


async def test_a_controller_silent_past_the_trusted_age_is_signalled_once_for_each_of_reprises_jobs(
    backend: SlurmBackend, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    slurm_id, done_id = [
        await backend.cli.submit(
            SlurmSubmission(name=allocation_name(job), nodes=1, script=ONE_TASK_PER_NODE, output=tmp_path / job)
        )
        for job in ("job-s", "job-done")
    ]
    await running(backend, slurm_id)
    await backend.cancel("job-done")  # an allocation that ended: Slurm still lists it, and it needs nothing more
    await eventually(lambda: backend.cli.job(done_id), lambda j: j is not None and j.state is SlurmJobState.CANCELLED)
    seen: list[ComputeSignal] = []

    async def emit(signal: ComputeSignal) -> None:
        seen.append(signal)

    watch = asyncio.create_task(backend.watch(emit))
    try:
        await asyncio.sleep(1)  # the baseline read, with the job running
        slurm_cluster.pause_controller()  # it accepts connections and answers nothing
        paused = time.monotonic()
        found = await eventually(lambda: _seen(seen), bool, timeout_s=backend.max_age_s + 3 * TIMEOUT_S)
        took = time.monotonic() - paused
        await asyncio.sleep(TIMEOUT_S + 1)  # more failed reads in the same outage: nothing new
    finally:
        watch.cancel()
        slurm_cluster.pause_controller(paused=False)
    assert found, "no signal of the silent controller"
    assert took >= backend.max_age_s - TIMEOUT_S  # not at a first failed read: only once Slurm's state is not trusted
    assert [(s.kind, s.job_id, s.node_id) for s in seen] == [(ComputeSignalKind.CONTROLLER_UNAVAILABLE, "job-s", None)]
    assert "controller does not answer" in seen[0].detail and "runs on" in seen[0].detail


async def _seen(signals: list[ComputeSignal]) -> list[ComputeSignal]:
    return list(signals)


def _node(name: str, *state: str, reason: str = "") -> SlurmNode:
    return SlurmNode(name=name, state=frozenset(state or ("IDLE",)), reason=reason)


def _job(
    slurm_id: int,
    state: SlurmJobState,
    *nodes: str,
    name: str = "reprise-job-a",
    restarts: int = 0,
    excluded: tuple[str, ...] = (),
) -> SlurmJob:
    return SlurmJob(
        job_id=slurm_id, name=name, state=state, nodes=nodes, restart_count=restarts, excluded_nodes=excluded
    )


HEALTHY = {"n1": _node("n1"), "n2": _node("n2")}
N2_DOWN = {"n1": _node("n1"), "n2": _node("n2", "DOWN", "NOT_RESPONDING", reason="Not responding")}


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        pytest.param(SlurmView(HEALTHY), SlurmView(HEALTHY), [], id="nothing changed"),
        pytest.param(
            SlurmView(HEALTHY),
            SlurmView({**HEALTHY, "n2": _node("n2", "IDLE", "NOT_RESPONDING")}),
            [(NOT_RESPONDING, "n2", None)],
            id="slurmd silent",
        ),
        pytest.param(
            SlurmView({**HEALTHY, "n2": _node("n2", "IDLE", "NOT_RESPONDING")}),
            SlurmView(N2_DOWN),
            [(DOWN, "n2", None)],
            id="then down: only what is new",
        ),
        pytest.param(SlurmView(HEALTHY), SlurmView({**HEALTHY, "n1": _node("n1", "IDLE", "DRAIN")}), [], id="drain"),
        pytest.param(
            SlurmView(HEALTHY, {7: _job(7, R, "n1", "n2")}),
            SlurmView(N2_DOWN, {7: _job(7, SlurmJobState.NODE_FAIL, "n1", "n2")}),
            [(DOWN, "n2", None), (NOT_RESPONDING, "n2", None), (NODE_FAIL, "n2", "job-a")],
            id="job ended NODE_FAIL",
        ),
        pytest.param(
            SlurmView(HEALTHY, {7: _job(7, R, "n1", "n2")}),
            SlurmView(N2_DOWN, {7: _job(7, P, restarts=1)}),
            [(DOWN, "n2", None), (NOT_RESPONDING, "n2", None), (NODE_FAIL, "n2", "job-a")],
            id="job requeued by Slurm after a node failed",
        ),
        pytest.param(
            SlurmView(HEALTHY, {7: _job(7, R, "n1", "n2")}),
            SlurmView(HEALTHY, {7: _job(7, P, restarts=1, excluded=("n2",))}),
            [],
            id="job requeued by us (its bad node left out)",
        ),
        pytest.param(
            SlurmView(HEALTHY, {7: _job(7, R, "n1", "n2")}),
            SlurmView(HEALTHY, {7: _job(7, P, restarts=1)}),
            [(ComputeSignalKind.PREEMPTED, None, "job-a")],
            id="job requeued with no node down or left out: preempted (PreemptMode=REQUEUE)",
        ),
        pytest.param(
            SlurmView(HEALTHY, {7: _job(7, R, "n1", "n2")}),
            SlurmView(HEALTHY, {7: _job(7, R, "n1", "n2", restarts=1)}),
            [(ComputeSignalKind.PREEMPTED, None, "job-a")],
            id="requeued and running again between two reads",
        ),
        pytest.param(
            SlurmView(HEALTHY, {7: _job(7, R, "n1")}),
            SlurmView(HEALTHY, {7: _job(7, SlurmJobState.PREEMPTED, "n1")}),
            [(ComputeSignalKind.PREEMPTED, None, "job-a")],
            id="preempted",
        ),
        pytest.param(
            SlurmView(HEALTHY, {7: _job(7, R, "n1")}),
            SlurmView(HEALTHY, {7: _job(7, SlurmJobState.TIMEOUT, "n1")}),
            [(ComputeSignalKind.TIME_LIMIT, None, "job-a")],
            id="time limit",
        ),
        pytest.param(
            SlurmView(HEALTHY, {7: _job(7, SlurmJobState.TIMEOUT, "n1")}),
            SlurmView(HEALTHY, {7: _job(7, SlurmJobState.TIMEOUT, "n1")}),
            [],
            id="an ended job read again",
        ),
        pytest.param(
            SlurmView(HEALTHY),
            SlurmView(HEALTHY, {8: _job(8, SlurmJobState.TIMEOUT, "n1")}),
            [(ComputeSignalKind.TIME_LIMIT, None, "job-a")],
            id="ran and ended between two reads",
        ),
        pytest.param(
            SlurmView(HEALTHY, {9: _job(9, R, "n1", name="someone else's")}),
            SlurmView(HEALTHY, {9: _job(9, SlurmJobState.PREEMPTED, "n1", name="someone else's")}),
            [],
            id="not one of ours",
        ),
    ],
)
def test_slurm_transitions_become_signals(
    before: SlurmView, after: SlurmView, expected: list[tuple[ComputeSignalKind, str | None, str | None]]
) -> None:
    found = signals(before, after, backend="slurm")
    assert Counter((s.kind, s.node_id, s.job_id) for s in found) == Counter(expected)
    again = signals(before, after, backend="slurm")  # another replica comparing the same reads
    assert [s.event_id for s in again] == [s.event_id for s in found]  # one message id: the stream keeps one
