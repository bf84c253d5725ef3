"""The agent with real NATS and real rank subprocesses: fenced idempotent commands, faults, reports."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from reprise_agent.agent import Agent
from reprise_agent.settings import AgentSettings
from reprise_cli.servers import NatsServer
from reprise_common import subjects
from reprise_common.bus import Bus, Delivery, Outcome
from reprise_common.events import (
    AgentCommand,
    CommandAction,
    CommandReply,
    CommandResult,
    Event,
    FaultKind,
    GpuHealth,
    GpuLost,
    GpuXid,
    InjectFault,
    InjectReply,
    NodeReport,
    RankExited,
)
from reprise_common.procs import process_alive

SLEEPER = [sys.executable, "-c", "import time, os; print('rank', os.environ['RANK'], flush=True); time.sleep(600)"]


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


class Harness:
    """An agent plus a client bus that records what the agent publishes."""

    def __init__(self, agent: Agent, client: Bus) -> None:
        self.agent = agent
        self.client = client
        self.events: list[Event] = []

    async def record(self, event: Event, delivery: Delivery) -> Outcome:
        self.events.append(event)
        return Outcome.ACK

    async def command(self, action: CommandAction, *, fence: int, command_id: str, **args: object) -> CommandReply:
        cmd = AgentCommand(command_id=command_id, job_id="job-1", fence=fence, action=action, args=dict(args))
        return await self.client.request(subjects.node_command("n1"), cmd, CommandReply, timeout=15)

    async def launch(self, *, fence: int, command_id: str, gpus: tuple[int, ...] = (0, 1)) -> CommandReply:
        ranks = [{"rank": i, "node_id": "n1", "gpu": gpu, "local_rank": i} for i, gpu in enumerate(gpus)]
        return await self.command(
            CommandAction.LAUNCH,
            fence=fence,
            command_id=command_id,
            restart_epoch=0,
            world_size=len(gpus),
            master_addr="127.0.0.1",
            master_port=29500,
            command=SLEEPER,
            ranks=ranks,
        )

    def of_type(self, kind: type[Event]) -> list[Event]:
        return [e for e in self.events if isinstance(e, kind)]


@pytest.fixture
async def harness(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Harness]:
    settings = AgentSettings(
        node_id="n1", nats_url=nats_server.url, state_dir=tmp_path / "agent", gpu_count=4, report_interval_s=0.1,
        stop_grace_s=2.0,
    )  # fmt: skip
    bus = Bus(url=nats_server.url, service="agent-n1")
    await bus.connect(attempts=10)
    agent = Agent(settings, bus)
    await agent.start()
    client = Bus(url=nats_server.url, service="test-client")
    await client.connect(attempts=10)
    h = Harness(agent, client)
    client.consumer(stream="AGENT", durable="test", filter_subject="reprise.agent.n1.>", handler=h.record).start()
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


async def test_stop_leaves_no_process_of_the_group(harness: Harness) -> None:
    reply = await harness.launch(fence=1, command_id="l")
    pids = reply.data["pids"]
    assert all(process_alive(pid) for pid in pids)
    stopped = await harness.command(CommandAction.STOP, fence=1, command_id="s", grace_s=2.0)
    assert stopped.result is CommandResult.DONE
    assert sorted(r["rank"] for r in stopped.data["stopped"]) == [0, 1]
    assert not any(process_alive(pid) for pid in pids)
    # a commanded stop is not a fault: no rank.exited event
    await asyncio.sleep(0.3)
    assert harness.of_type(RankExited) == []


async def test_killed_rank_is_reported_with_signal_and_log_tail(harness: Harness) -> None:
    reply = await harness.launch(fence=1, command_id="l")
    assert await wait_for(lambda: all(r.tail for r in harness.agent.supervisor.ranks()))
    os.kill(reply.data["pids"][1], 9)
    assert await wait_for(lambda: len(harness.of_type(RankExited)) == 1)
    exited = harness.of_type(RankExited)[0]
    assert isinstance(exited, RankExited)
    assert exited.rank == 1 and exited.signal == "SIGKILL" and exited.exit_code is None
    assert exited.log_tail == ["rank 1"]


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
    cmd = AgentCommand(
        command_id="oom", job_id="job-oom", fence=1, action=CommandAction.LAUNCH,
        args={"restart_epoch": 0, "world_size": 1, "master_addr": "127.0.0.1", "master_port": 29500,
              "command": ["sh", "-c", hog], "ranks": [{"rank": 0, "node_id": "n1", "gpu": 0, "local_rank": 0}]},
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
    report = await agent.report()
    assert report.gpus == [] and report.gpu_error.startswith("NVML unavailable")
    answer = await bus.request(subjects.node_inject("n2"), InjectFault(kind=FaultKind.XID, gpu=0, xid=79), InjectReply)
    assert not answer.accepted and "needs the sim backend" in answer.detail
    await agent.stop()
    await bus.close()
