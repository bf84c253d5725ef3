"""The agent with real NATS and real rank subprocesses: fenced idempotent commands, faults, reports."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from reprise_agent.agent import Agent
from reprise_agent.launch.processes import ProcessLauncher
from reprise_agent.ranks import RankProcess, RankSupervisor
from reprise_agent.settings import AgentSettings
from reprise_cli.servers import NatsServer, free_port
from reprise_common import subjects
from reprise_common.aio import poll_until
from reprise_common.bus import Bus, Delivery, Outcome
from reprise_common.events import (
    AnyCommand,
    CheckpointSaved,
    CommandAction,
    CommandReply,
    CommandResult,
    DependencyFailed,
    Event,
    FaultKind,
    GpuHealth,
    GpuLost,
    GpuXid,
    InjectFault,
    InjectReply,
    LaunchArgs,
    LaunchCommand,
    NodeReport,
    RankAssignment,
    RankExited,
    RankNumeric,
    RankStacks,
    ResumeFile,
)
from reprise_common.procs import ProcessSample, process_alive, sample_process, start_ticks

COMMANDS: TypeAdapter[AnyCommand] = TypeAdapter(AnyCommand)
SLEEPER = [sys.executable, "-c", "import time, os; print('rank', os.environ['RANK'], flush=True); time.sleep(600)"]


async def wait_for(predicate: Callable[[], object], timeout_s: float = 10.0) -> bool:
    return await poll_until(predicate, timeout_s=timeout_s)


class Harness:
    """An agent plus a client bus that records what the agent publishes."""

    def __init__(self, agent: Agent, client: Bus) -> None:
        self.agent = agent
        self.client = client
        self.events: list[Event] = []

    async def record(self, event: Event, delivery: Delivery) -> Outcome:
        self.events.append(event)
        return Outcome.ACK

    async def record_reports(self, reports: dict[str, bytes]) -> None:
        self.events.extend(NodeReport.model_validate_json(data) for data in reports.values())

    async def command(self, action: CommandAction, *, fence: int, command_id: str, **args: object) -> CommandReply:
        fields = {"command_id": command_id, "job_id": "job-1", "fence": fence, "action": action, "args": dict(args)}
        cmd = COMMANDS.validate_python(fields)
        return await self.client.request(subjects.node_command("n1"), cmd, CommandReply, timeout=15)

    async def launch(
        self,
        *,
        fence: int,
        command_id: str,
        gpus: tuple[int, ...] = (0, 1),
        command: list[str] = SLEEPER,
        restart_epoch: int = 0,
        **extra: object,
    ) -> CommandReply:
        ranks = [{"rank": i, "node_id": "n1", "gpu": gpu, "local_rank": i} for i, gpu in enumerate(gpus)]
        return await self.command(
            CommandAction.LAUNCH,
            fence=fence,
            command_id=command_id,
            restart_epoch=restart_epoch,
            world_size=len(gpus),
            master_addr="127.0.0.1",
            master_port=29500,
            command=command,
            ranks=ranks,
            **extra,
        )

    def of_type(self, kind: type[Event]) -> list[Event]:
        return [e for e in self.events if isinstance(e, kind)]


@pytest.fixture
async def harness(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Harness]:
    async with running_agent(nats_server, tmp_path, report_interval_s=0.1) as h:
        yield h


@contextlib.asynccontextmanager
async def running_agent(
    nats_server: NatsServer, tmp_path: Path, *, report_interval_s: float, **settings_: object
) -> AsyncIterator[Harness]:
    settings = AgentSettings(
        node_id="n1", nats_url=nats_server.url, state_dir=tmp_path / "agent", gpu_count=4,
        report_interval_s=report_interval_s, stop_grace_s=2.0, **settings_,
    )  # fmt: skip
    bus = Bus(url=nats_server.url, service="agent-n1")
    await bus.connect(attempts=10)
    agent = Agent(settings, bus)
    await agent.start()
    client = Bus(url=nats_server.url, service="test-client")
    await client.connect(attempts=10)
    h = Harness(agent, client)
    client.consumer(stream="AGENT", durable="test", filter_subject="reprise.agent.n1.>", handler=h.record).start()
    await client.follow(subjects.node_report("n1"), handler=h.record_reports).open()  # reports: core NATS
    yield h
    await agent.stop()
    await bus.close()
    await client.close()


async def test_repeated_command_id_runs_once(harness: Harness) -> None:
    first = await harness.launch(fence=1, command_id="rec-1:launch:n1")
    again = await harness.launch(fence=1, command_id="rec-1:launch:n1")
    assert first.result is CommandResult.DONE and not first.duplicate
    assert again.duplicate and again.data == first.data
    assert len([r for r in harness.agent.supervisor.ranks() if r.alive]) == 2
    assert harness.agent.book.executed == 1


async def test_stale_fence_is_rejected(harness: Harness) -> None:
    await harness.launch(fence=5, command_id="a")
    stale = await harness.command(CommandAction.STOP, fence=4, command_id="b")
    assert stale.result is CommandResult.REJECTED_STALE_FENCE
    assert "highest seen is 5" in stale.detail
    assert all(r.alive for r in harness.agent.supervisor.ranks())


async def test_a_replaced_owner_repeating_a_command_id_gets_stale_not_the_cached_answer(harness: Harness) -> None:
    new_owner = await harness.launch(fence=7, command_id="rec-1:launch:n1")  # the successor resumed the recovery
    old_owner = await harness.launch(fence=6, command_id="rec-1:launch:n1")  # the paused owner wakes up
    assert new_owner.result is CommandResult.DONE
    assert old_owner.result is CommandResult.REJECTED_STALE_FENCE and not old_owner.duplicate
    assert harness.agent.book.executed == 1
    assert {r.status().restart_epoch for r in harness.agent.supervisor.ranks()} == {0}


async def test_stop_leaves_no_process_of_the_group(harness: Harness) -> None:
    reply = await harness.launch(fence=1, command_id="l")
    pids = reply.data["pids"]
    assert all(process_alive(pid) for pid in pids)

    def alive() -> dict[datetime, list[int]]:
        reports = [e for e in harness.of_type(NodeReport) if isinstance(e, NodeReport)]
        return {report.time: [r.rank for r in report.ranks if r.alive] for report in reports}

    assert await wait_for(lambda: [0, 1] in alive().values())
    stopped = await harness.command(CommandAction.STOP, fence=1, command_id="s", grace_s=2.0)
    assert stopped.result is CommandResult.DONE
    assert sorted(r["rank"] for r in stopped.data["stopped"]) == [0, 1]
    assert not any(process_alive(pid) for pid in pids)
    # a commanded stop is not a fault: no rank.exited event
    await asyncio.sleep(0.3)
    assert harness.of_type(RankExited) == []
    # The answer says when the ranks had ended, on the clock of the node's reports: a report built since shows none
    # alive, so the orchestrator can tell a report from before the stop (its ranks alive: strays) from one after.
    ended = datetime.fromisoformat(stopped.data["ended_at"])
    seen = alive()
    assert any(ranks == [0, 1] for when, ranks in seen.items() if when < ended), seen
    assert [ranks for when, ranks in seen.items() if when >= ended] and all(
        ranks == [] for when, ranks in seen.items() if when >= ended
    ), seen


async def test_killed_rank_is_reported_with_signal_and_log_tail(harness: Harness) -> None:
    reply = await harness.launch(fence=1, command_id="l")
    assert await wait_for(lambda: all(r.tail for r in harness.agent.supervisor.ranks()))
    os.kill(reply.data["pids"][1], 9)
    assert await wait_for(lambda: len(harness.of_type(RankExited)) == 1)
    exited = harness.of_type(RankExited)[0]
    assert isinstance(exited, RankExited)
    assert exited.rank == 1 and exited.signal == "SIGKILL" and exited.exit_code is None
    assert exited.log_tail == ["rank 1"]
    assert exited.restart_epoch == 0  # the launch it belonged to (the detector puts it on the incident)


async def test_xid79_kills_rank_on_that_gpu_and_reports_gpu_lost(harness: Harness) -> None:
    await harness.launch(fence=1, command_id="l", gpus=(1, 2))
    fault = InjectFault(kind=FaultKind.XID, gpu=2, xid=79)
    answer = await harness.client.request(subjects.node_inject("n1"), fault, InjectReply)
    assert answer.accepted and "killed rank 1" in answer.detail
    assert await wait_for(lambda: harness.of_type(GpuXid) and harness.of_type(GpuLost) and harness.of_type(RankExited))
    xid = harness.of_type(GpuXid)[0]
    assert isinstance(xid, GpuXid) and (xid.gpu, xid.xid) == (2, 79)
    exited = harness.of_type(RankExited)[0]
    assert isinstance(exited, RankExited) and exited.rank == 1
    # the XID is published before the rank's death
    assert harness.events.index(xid) < harness.events.index(exited)

    def gpu2_lost_in_report() -> bool:
        reports = [e for e in harness.of_type(NodeReport) if isinstance(e, NodeReport)]
        return bool(reports) and reports[-1].gpus[2].health is GpuHealth.LOST

    assert await wait_for(gpu2_lost_in_report)
    survivors = [r for r in harness.agent.supervisor.ranks() if r.alive]
    assert [r.rank for r in survivors] == [0]


def _process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def test_rank_faults_kill_or_freeze_the_named_rank(harness: Harness) -> None:
    reply = await harness.launch(fence=1, command_id="l", gpus=(0, 1))
    pids = reply.data["pids"]
    hang = InjectFault(kind=FaultKind.RANK_HANG, rank=1, job_id="job-1")
    frozen = await harness.client.request(subjects.node_inject("n1"), hang, InjectReply)
    assert frozen.accepted and "froze (SIGSTOP) rank 1" in frozen.detail
    assert await wait_for(lambda: _process_state(pids[1]) == "T")  # stopped, not dead: a hang, not a crash
    kill = InjectFault(kind=FaultKind.RANK_KILL, rank=0)
    killed = await harness.client.request(subjects.node_inject("n1"), kill, InjectReply)
    assert killed.accepted and "killed rank 0" in killed.detail
    assert await wait_for(lambda: len(harness.of_type(RankExited)) == 1)
    exited = harness.of_type(RankExited)[0]
    assert isinstance(exited, RankExited) and (exited.rank, exited.signal) == (0, "SIGKILL")
    missing = await harness.client.request(
        subjects.node_inject("n1"), InjectFault(kind=FaultKind.RANK_KILL, rank=7), InjectReply
    )
    assert not missing.accepted and "no live rank 7" in missing.detail
    stop = await harness.command(CommandAction.STOP, fence=1, command_id="s", grace_s=5)
    assert stop.result is CommandResult.DONE  # the frozen rank is woken so it can take its SIGTERM
    assert not any(r.alive for r in harness.agent.supervisor.ranks())


async def test_bad_injection_is_refused_with_a_reason(harness: Harness) -> None:
    answer = await harness.client.request(
        subjects.node_inject("n1"), InjectFault(kind=FaultKind.XID, gpu=9, xid=79), InjectReply
    )
    assert not answer.accepted and "no GPU 9" in answer.detail


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A cgroup (v1 or v2) with a 64 MiB memory limit, where this machine lets us make one."""
    name = f"reprise-oom-{os.getpid()}"
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    try:
        if (v1 / "memory.limit_in_bytes").exists():
            group = v1 / name
            group.mkdir()
            (group / "memory.limit_in_bytes").write_text(str(64 * 2**20))
        else:
            group = v2 / name
            group.mkdir()
            (group / "memory.max").write_text(str(64 * 2**20))
            (group / "memory.swap.max").write_text("0")
    except OSError as exc:
        pytest.skip(f"cannot create a memory-limited cgroup here: {exc}")
    yield group
    group.rmdir()


async def test_oom_kill_is_reported_as_such(harness: Harness, memory_cgroup: Path) -> None:
    hog = (
        f"echo $$ > {memory_cgroup}/cgroup.procs && exec {sys.executable} -c "
        "'import time; b = bytearray(512 * 2**20); time.sleep(30)'"
    )
    cmd = LaunchCommand(
        command_id="oom", job_id="job-oom", fence=1,
        args=LaunchArgs(restart_epoch=0, world_size=1, master_addr="127.0.0.1", master_port=29500,
                        command=["sh", "-c", hog], ranks=[RankAssignment(rank=0, node_id="n1", gpu=0, local_rank=0)]),
    )  # fmt: skip
    reply = await harness.client.request(subjects.node_command("n1"), cmd, CommandReply, timeout=15)
    assert reply.result is CommandResult.DONE
    assert await wait_for(lambda: len(harness.of_type(RankExited)) == 1, timeout_s=20)
    exited = harness.of_type(RankExited)[0]
    assert isinstance(exited, RankExited)
    assert exited.signal == "SIGKILL" and exited.oom_killed


async def test_killed_rank_without_oom_is_not_called_oom(harness: Harness) -> None:
    reply = await harness.launch(fence=1, command_id="l")
    os.kill(reply.data["pids"][0], 9)
    assert await wait_for(lambda: len(harness.of_type(RankExited)) == 1)
    exited = harness.of_type(RankExited)[0]
    assert isinstance(exited, RankExited) and not exited.oom_killed


async def test_agent_without_nvml_reports_why_and_keeps_running(nats_server: NatsServer, tmp_path: Path) -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("NVML works on this machine: the degrade path is not reachable")
    settings = AgentSettings(node_id="n2", nats_url=nats_server.url, state_dir=tmp_path, gpu_backend="nvml")
    bus = Bus(url=nats_server.url, service="agent-n2")
    await bus.connect(attempts=10)
    agent = Agent(settings, bus)
    await agent.start()
    report = await agent.reporter.report()
    assert report.gpus == [] and report.gpu_error.startswith("NVML unavailable")
    answer = await bus.request(subjects.node_inject("n2"), InjectFault(kind=FaultKind.XID, gpu=0, xid=79), InjectReply)
    assert not answer.accepted and "needs the sim backend" in answer.detail
    await agent.stop()
    await bus.close()


TRAINER = [
    sys.executable,
    "-c",
    "import time, reprise_sdk\n"
    "time.sleep(2)\n"  # the first heartbeat comes well after the launch answer, even on a loaded machine
    "for step in range(1, 100000):\n"
    "    time.sleep(0.01)\n"
    "    reprise_sdk.heartbeat(step, loss=1.0 / step)\n"
    "    if step == 30:\n"
    "        with reprise_sdk.phase('checkpointing'):\n"
    "            digests = {'/ckpt/30/r.pt': (4, 'ab' * 32)}\n"
    "            reprise_sdk.checkpoint_saved('/ckpt/30', 30, ['/ckpt/30/r.pt'], sha256=digests)\n",
]


async def test_sdk_progress_reaches_the_report_and_checkpoints_become_events(harness: Harness) -> None:
    reply = await harness.launch(fence=1, command_id="sdk", command=TRAINER, restart_epoch=3)
    assert reply.result is CommandResult.DONE, reply.detail
    assert harness.agent.depchecks.watched_rendezvous() == []  # not before the job proves it is past rendezvous

    def progressed() -> bool:
        reports = [e for e in harness.of_type(NodeReport) if isinstance(e, NodeReport)]
        return bool(reports) and len(reports[-1].ranks) == 2 and all((r.step or 0) > 40 for r in reports[-1].ranks)

    assert await wait_for(progressed, timeout_s=20)
    report = [e for e in harness.of_type(NodeReport) if isinstance(e, NodeReport)][-1]
    for status in report.ranks:
        assert status.phase == "training" and status.step_time_p50_s is not None
        assert (status.heartbeat_age_s or 99) < 2
    assert harness.agent.depchecks.watched_rendezvous() == ["job-1"]
    assert await wait_for(lambda: len(harness.of_type(CheckpointSaved)) == 2)
    saved = sorted(
        (e for e in harness.of_type(CheckpointSaved) if isinstance(e, CheckpointSaved)), key=lambda e: e.rank
    )
    assert all(
        [(d.path, d.size_bytes, d.digest, d.algorithm) for d in e.file_digests]
        == [("/ckpt/30/r.pt", 4, "ab" * 32, "sha256")]
        for e in saved
    )
    assert [(e.rank, e.step, e.path, e.restart_epoch, e.files, e.world_size) for e in saved] == [
        (0, 30, "/ckpt/30", 3, ["/ckpt/30/r.pt"], 2),
        (1, 30, "/ckpt/30", 3, ["/ckpt/30/r.pt"], 2),
    ]


async def test_a_rank_of_a_new_launch_is_reported_at_its_first_heartbeat_not_at_the_next_interval(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The recovery that launched a rank waits for its first step: the node reports it then, not 60 s later."""
    async with running_agent(nats_server, tmp_path, report_interval_s=60.0) as harness:
        reply = await harness.launch(fence=1, command_id="early", command=TRAINER, restart_epoch=4)
        assert reply.result is CommandResult.DONE, reply.detail

        def stepping() -> list[NodeReport]:
            reports = [e for e in harness.of_type(NodeReport) if isinstance(e, NodeReport)]
            return [r for r in reports if r.ranks and any(s.step is not None for s in r.ranks)]

        assert await wait_for(stepping, timeout_s=30)
        first = stepping()[0]
        assert {(s.rank, s.restart_epoch) for s in first.ranks} == {(0, 4), (1, 4)}
        assert harness.agent.reporter.early >= 1


async def test_a_stopping_agent_says_so_in_its_last_report_before_its_connection_closes(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The detector sees the closed connection of an agent at once: a graceful stop must not read as a node loss."""
    async with running_agent(nats_server, tmp_path, report_interval_s=60.0) as harness:
        await harness.agent.stop()

        def stopping() -> list[NodeReport]:
            return [e for e in harness.of_type(NodeReport) if isinstance(e, NodeReport) and e.stopping]

        assert await wait_for(stopping)
        assert harness.agent.bus.connected  # said before the connection closes (the stack closes it after)


async def test_stopped_rank_shows_a_growing_heartbeat_age(harness: Harness) -> None:
    ranks = [{"rank": 0, "node_id": "n1", "gpu": 0, "local_rank": 0}]
    reply = await harness.command(
        CommandAction.LAUNCH, fence=1, command_id="hang", restart_epoch=0, world_size=1,
        master_addr="127.0.0.1", master_port=29500, command=TRAINER, ranks=ranks,
    )  # fmt: skip
    statuses = lambda: [r for e in harness.of_type(NodeReport) if isinstance(e, NodeReport) for r in e.ranks]  # noqa: E731
    assert await wait_for(lambda: any((r.step or 0) > 5 for r in statuses()), timeout_s=20)
    os.kill(reply.data["pids"][0], signal.SIGSTOP)
    try:
        seen = len(statuses())
        assert await wait_for(lambda: len(statuses()) > seen + 5, timeout_s=10)
        after = statuses()[seen:]
        ages = [r.heartbeat_age_s or 0.0 for r in after]
        assert ages[-1] > ages[0] + 0.3 and ages[-1] > 0.5
        assert len({r.step for r in after[1:]}) == 1  # the step stands still while the age grows
        assert after[-1].alive
    finally:
        os.kill(reply.data["pids"][0], signal.SIGCONT)


async def test_a_rank_reports_how_long_it_has_been_in_its_state(harness: Harness) -> None:
    """The detector folds a node's reports a few seconds apart: the state's age says when a rank was first seen
    stopped, as the step's heartbeat age says when its step finished."""
    reply = await harness.launch(fence=1, command_id="l", command=LOOPER)
    pid = reply.data["pids"][0]
    statuses = lambda: [r for e in harness.of_type(NodeReport) if isinstance(e, NodeReport) for r in e.ranks]  # noqa: E731
    assert await wait_for(lambda: any(r.proc_state in ("S", "R") for r in statuses()))
    os.kill(pid, signal.SIGSTOP)
    try:
        assert await wait_for(lambda: len([r for r in statuses() if r.proc_state == "T"]) >= 3, timeout_s=10)
        stopped = [r.proc_state_age_s for r in statuses() if r.proc_state == "T"]
        assert stopped[0] is not None and stopped[0] < 0.5  # the first sample that saw it stopped
        assert all(b is not None and a is not None and b > a for a, b in itertools.pairwise(stopped))
    finally:
        os.kill(pid, signal.SIGCONT)
    seen = len(statuses())
    assert await wait_for(lambda: any(r.proc_state != "T" for r in statuses()[seen:]), timeout_s=10)
    resumed = next(r for r in statuses()[seen:] if r.proc_state != "T")
    assert resumed.proc_state_age_s is not None and resumed.proc_state_age_s < 2.0  # a new state, a new age


async def test_an_unreachable_rendezvous_master_is_reported_for_its_job_only(harness: Harness) -> None:
    harness.agent.depchecks.rendezvous_grace_s = 0  # watched as if the job had trained past its rendezvous long ago
    harness.agent.depchecks.set_rendezvous("job-1", "127.0.0.1", free_port())  # nothing listens there

    def failed() -> list[DependencyFailed]:
        return [e for e in harness.events if isinstance(e, DependencyFailed)]

    assert await wait_for(failed, timeout_s=15)  # the dependency loop runs every 5 s
    assert {(e.dependency, e.job_id, e.node_id) for e in failed()} == {("rendezvous:job-1", "job-1", "n1")}


async def test_a_rank_restoring_a_checkpoint_is_handed_the_registrys_digests(harness: Harness, tmp_path: Path) -> None:
    out = tmp_path / "seen.json"
    show = (
        "import json, os, sys; json.dump({k: os.environ.get(k, '') for k in "
        "('REPRISE_RESUME_CHECKPOINT', 'REPRISE_RESUME_FILES')}, open(sys.argv[1], 'w'))"
    )
    files = [ResumeFile(path="rank-00000.pt", size_bytes=700, algorithm="sha256", digest="ab" * 32)]
    cmd = LaunchCommand(
        command_id="resume", job_id="job-r", fence=1,
        args=LaunchArgs(restart_epoch=3, world_size=1, master_addr="127.0.0.1", master_port=29500,
                        command=[sys.executable, "-c", show, str(out)], resume_checkpoint=str(tmp_path / "step-50"),
                        resume_files=files, ranks=[RankAssignment(rank=0, node_id="n1", gpu=0, local_rank=0)]),
    )  # fmt: skip
    reply = await harness.client.request(subjects.node_command("n1"), cmd, CommandReply, timeout=15)
    assert reply.result is CommandResult.DONE
    assert await wait_for(lambda: out.exists() and out.read_text().endswith("}"), timeout_s=20)
    seen = await asyncio.to_thread(lambda: json.loads(out.read_text()))
    assert seen["REPRISE_RESUME_CHECKPOINT"] == str(tmp_path / "step-50")
    listed = await asyncio.to_thread(lambda: json.loads(Path(seen["REPRISE_RESUME_FILES"]).read_text()))
    assert listed == [{"path": "rank-00000.pt", "size_bytes": 700, "algorithm": "sha256", "digest": "ab" * 32}]


def test_an_agent_restarted_after_its_ranks_died_leaves_a_process_that_reused_their_pid_alone(
    tmp_path: Path,
) -> None:
    # The ledger names a rank that died with the agent; by the time the agent is back, its pid (and group id) may be
    # another process's. The orphan sweep must not kill that stranger, and still reports the rank as lost.
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        started = start_ticks(stranger.pid)
        assert started is not None
        ledger = tmp_path / "ranks" / "live.json"
        ledger.parent.mkdir(parents=True)
        entry = {"job_id": "job-1", "rank": 0, "restart_epoch": 2, "pid": stranger.pid, "started": started - 5,
                 "log": str(tmp_path / "rank-0.log")}  # fmt: skip
        ledger.write_text(json.dumps([entry]))

        async def on_exit(rank: RankProcess) -> None:
            raise AssertionError("no rank ran")

        supervisor = RankSupervisor(node_id="node-a", state_dir=tmp_path, launcher=ProcessLauncher(), on_exit=on_exit)
        lost = supervisor.orphans()
        assert [(r.job_id, r.rank, r.restart_epoch) for r in lost] == [("job-1", 0, 2)]
        time.sleep(0.2)
        assert stranger.poll() is None
        assert json.loads(ledger.read_text()) == []
    finally:
        stranger.kill()
        stranger.wait()


LOOPER = [
    sys.executable,
    "-c",
    "import os, time\n"
    "def wait_for_peers():\n"
    "    while True:\n"
    "        time.sleep(0.05)\n"
    "print('rank', os.environ['RANK'], flush=True)\n"
    "wait_for_peers()\n",
]


async def test_a_capture_reads_every_ranks_stack_leaves_them_running_and_happens_once_per_incident(
    harness: Harness,
) -> None:
    reply = await harness.launch(fence=1, command_id="l", command=LOOPER)
    pids = reply.data["pids"]
    assert await wait_for(lambda: all(r.tail for r in harness.agent.supervisor.ranks()))
    os.kill(pids[1], signal.SIGSTOP)  # frozen: its stack is still read, and its state says so
    # The kernel stops it once it runs to take the signal: on a loaded host it is runnable (R) until then.
    assert await wait_for(lambda: (sample_process(pids[1]) or ProcessSample("", 0)).state == "T")
    capture = {"incident_id": "inc-1", "within_s": 2.0}
    captured = await harness.command(CommandAction.CAPTURE_STACKS, fence=1, command_id="c", **capture)
    assert captured.result is CommandResult.DONE
    assert captured.data == {"captured": [0, 1], "failed": []}
    assert all(process_alive(pid) for pid in pids)  # a capture stops nothing: the stop comes after every node's
    assert await wait_for(lambda: len(harness.of_type(RankStacks)) == 2)
    found = sorted((e for e in harness.of_type(RankStacks) if isinstance(e, RankStacks)), key=lambda e: e.rank)
    assert [(e.rank, e.pid, e.incident_id, e.job_id, e.error) for e in found] == [
        (0, pids[0], "inc-1", "job-1", ""),
        (1, pids[1], "inc-1", "job-1", ""),
    ]
    assert found[0].proc_state in ("S", "R") and found[1].proc_state == "T"
    for event in found:
        assert [f.function for f in event.threads[0].frames[:2]] == ["wait_for_peers", "<module>"]

    again = await harness.command(CommandAction.CAPTURE_STACKS, fence=1, command_id="c2", **capture)
    assert again.result is CommandResult.DONE and again.data == {"captured": [], "failed": []}
    await asyncio.sleep(0.5)
    assert len(harness.of_type(RankStacks)) == 2  # that incident's stacks were captured already
    stopped = await harness.command(CommandAction.STOP, fence=1, command_id="s", grace_s=2.0)
    assert stopped.result is CommandResult.DONE
    assert not any(process_alive(pid) for pid in pids)


async def test_a_capture_without_py_spy_or_past_its_bound_reports_why(harness: Harness, tmp_path: Path) -> None:
    slow = tmp_path / "py-spy"
    slow.write_text("#!/bin/sh\nsleep 30\n")
    slow.chmod(0o755)
    harness.agent.executor.py_spy = slow
    await harness.launch(fence=1, command_id="l", command=LOOPER)
    began = time.monotonic()
    capture = {"incident_id": "inc-2", "within_s": 0.5}
    captured = await harness.command(CommandAction.CAPTURE_STACKS, fence=1, command_id="c", **capture)
    assert captured.result is CommandResult.DONE and time.monotonic() - began < 0.5 + 1.0
    assert captured.data == {"captured": [0, 1], "failed": [0, 1]}
    assert await wait_for(lambda: len(harness.of_type(RankStacks)) == 2)
    assert {e.error for e in harness.of_type(RankStacks) if isinstance(e, RankStacks)} == {
        "py-spy did not answer within 0.5 s"
    }

    harness.agent.executor.py_spy = None
    capture = {"incident_id": "inc-3", "within_s": 0.5}
    await harness.command(CommandAction.CAPTURE_STACKS, fence=1, command_id="c2", **capture)
    assert await wait_for(lambda: len(harness.of_type(RankStacks)) == 4)
    assert [e.error for e in harness.of_type(RankStacks)[2:] if isinstance(e, RankStacks)] == [
        "py-spy is not installed on this node"
    ] * 2


NAN_AT_STEP_5 = [
    sys.executable,
    "-c",
    "import time, reprise_sdk\n"
    "for step in range(1, 100000):\n"
    "    time.sleep(0.01)\n"
    "    reprise_sdk.heartbeat(step, loss=float('nan') if step >= 5 else 2.0, lr=1e-3)\n",
]


async def test_a_watched_metric_gone_nan_is_published_once_with_its_step(harness: Harness) -> None:
    watch = {"metrics": ["loss"]}
    reply = await harness.launch(fence=1, command_id="nan", command=NAN_AT_STEP_5, restart_epoch=2, numeric=watch)
    assert reply.result is CommandResult.DONE, reply.detail
    assert await wait_for(lambda: len(harness.of_type(RankNumeric)) >= 2, timeout_s=30)
    await asyncio.sleep(0.5)  # the NaN goes on: still one event per rank
    found = sorted((e for e in harness.of_type(RankNumeric) if isinstance(e, RankNumeric)), key=lambda e: e.rank)
    assert [(e.rank, e.restart_epoch, e.metric, e.kind, e.step, e.last_good_step) for e in found] == [
        (0, 2, "loss", "nan", 5, 1),  # the SDK sent the first NaN at once (the exact step); 2-4 rode on nothing
        (1, 2, "loss", "nan", 5, 1),
    ]


STANDBY_RANK = """
import os, time
print("rank", os.environ["RANK"], "on", os.getpid(), flush=True)
time.sleep(600)
"""


async def test_ranks_start_on_warm_standbys_which_the_report_shows_and_the_agent_replaces(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(STANDBY_RANK)
    async with running_agent(
        nats_server, tmp_path, report_interval_s=0.1, standbys=2, standby_preload=["decimal"], standby_refill_delay_s=0
    ) as harness:

        def standbys() -> list[tuple[int, bool, int | None]]:
            reports = [e for e in harness.of_type(NodeReport) if isinstance(e, NodeReport)]
            return [(s.pid, s.ready, s.rss_bytes) for s in reports[-1].standbys] if reports else []

        assert await wait_for(lambda: [s for s in standbys() if s[1]][1:], timeout_s=60)
        waiting = {pid for pid, _, rss in standbys()}
        assert all(rss and rss > 1_000_000 for _, _, rss in standbys())
        first = await harness.launch(fence=1, command_id="first", command=[sys.executable, str(script)])
        assert first.result is CommandResult.DONE, first.detail
        assert not set(first.data["pids"]) & waiting  # a job's first start leaves the standbys for its faults
        stop = await harness.command(CommandAction.STOP, fence=1, command_id="first-stop", grace_s=1.0)
        assert stop.result is CommandResult.DONE
        reply = await harness.launch(fence=2, command_id="warm", command=[sys.executable, str(script)], restart_epoch=1)
        assert reply.result is CommandResult.DONE, reply.detail
        assert set(reply.data["pids"]) == waiting  # both ranks of the relaunch run on the standbys that waited
        ranks = harness.agent.supervisor.ranks()
        assert await wait_for(lambda: all("rank " in r.log_path.read_text() for r in ranks if r.log_path.exists()))
        assert await wait_for(lambda: len([s for s in standbys() if s[1] and s[0] not in waiting]) == 2, timeout_s=60)
        stop = await harness.command(CommandAction.STOP, fence=2, command_id="warm-stop", grace_s=1.0)
        assert stop.result is CommandResult.DONE
        assert not any(process_alive(pid) for pid in waiting)
