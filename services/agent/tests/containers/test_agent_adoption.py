"""An agent's process SIGKILLed with its job's ranks running in containers (a real agent process, a real dockerd): the
next agent adopts them from its predecessor's ledger and supervises on: no rank reported lost, heartbeats reach the
new agent's SDK socket, output reaches the rank's log, a rank's death is reported once, a stop parks one through its
inbox and ends the other."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import docker
import pytest

from reprise_agent.agent import Agent
from reprise_cli.servers import NatsServer
from reprise_common.bus import Bus
from reprise_common.events import CommandAction, CommandResult, NodeReport, RankExited

from ..test_agent import Harness, running_agent, wait_for
from .conftest import PYTHON, Engine, python_mounts

HEARTBEATS = """
import time, reprise_sdk

def train(info):
    print(f"enter epoch={info.restart_epoch} rank={info.rank}", flush=True)
    step = 0
    while True:
        step += 1
        reprise_sdk.heartbeat(step)
        print(f"step {step}", flush=True)
        time.sleep(0.1)

reprise_sdk.run(train)
"""

AGENT = """
import asyncio
from reprise_agent.agent import Agent
from reprise_agent.settings import AgentSettings
from reprise_common.bus import Bus

async def main():
    settings = AgentSettings()
    bus = Bus(url=settings.nats_url, service="agent-n1")
    await bus.connect(attempts=10)
    await Agent(settings, bus).start()
    print("agent started", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def agent_env(nats: NatsServer, tmp_path: Path, engine: Engine, roots: list[Path]) -> dict[str, str]:
    return os.environ | {
        "REPRISE_NODE_ID": "n1", "REPRISE_NATS_URL": nats.url, "REPRISE_STATE_DIR": str(tmp_path / "agent"),
        "REPRISE_GPU_COUNT": "4", "REPRISE_REPORT_INTERVAL_S": "0.1", "REPRISE_DOCKER_URL": engine.url,
        "REPRISE_CONTAINER_MOUNT_ROOTS": json.dumps([str(r) for r in roots]),
    }  # fmt: skip


@pytest.fixture
async def first_agent(
    nats_server: NatsServer, tmp_path: Path, docker_engine: Engine
) -> AsyncIterator[asyncio.subprocess.Process]:
    """The agent's first process: a real one, killed by the test."""
    roots = [*(Path(m.source) for m in python_mounts()), tmp_path]
    (tmp_path / "agent_main.py").write_text(AGENT)
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(tmp_path / "agent_main.py"), env=agent_env(nats_server, tmp_path, docker_engine, roots),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert process.stdout is not None
    while b"agent started" not in (line := await asyncio.wait_for(process.stdout.readline(), 60)):
        assert line, "the first agent died before it started"
    yield process
    if process.returncode is None:
        process.kill()
        await process.wait()


def ledger(tmp_path: Path) -> list[dict[str, object]]:
    try:
        return list(json.loads((tmp_path / "agent" / "ranks" / "live.json").read_text()))
    except (OSError, ValueError):
        return []


def latest_steps(harness: Harness) -> dict[int, int]:
    reports = [e for e in harness.events if isinstance(e, NodeReport)]
    return {r.rank: r.step for r in reports[-1].ranks if r.step} if reports else {}


async def launch_two_ranks(nats_server: NatsServer, job_dir: Path, image: str, master_port: int) -> list[int]:
    """Launch the job's two ranks through the bus (the first agent runs in its own process); their pids."""
    mounts = [*(m.model_dump() for m in python_mounts()), {"source": str(job_dir), "target": str(job_dir)}]
    client = Bus(url=nats_server.url, service="test-launcher")
    await client.connect(attempts=10)
    try:
        reply = await Harness(cast(Agent, None), client).command(
            CommandAction.LAUNCH, fence=1, command_id="l0", restart_epoch=0, world_size=2, master_addr="127.0.0.1",
            master_port=master_port, command=[PYTHON, str(job_dir / "train.py")],
            container={"image": image, "mounts": mounts},
            ranks=[{"rank": i, "node_id": "n1", "gpu": i, "local_rank": i} for i in range(2)],
        )  # fmt: skip
    finally:
        await client.close()
    assert reply.result is CommandResult.DONE, reply
    return [int(pid) for pid in reply.data["pids"]]


async def test_a_restarted_agent_adopts_its_predecessors_containers_and_supervises_them(
    first_agent: asyncio.subprocess.Process, nats_server: NatsServer, tmp_path: Path, docker_engine: Engine
) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "train.py").write_text(HEARTBEATS)
    master = socket.create_server(("127.0.0.1", 0))  # rank 1's SDK waits for a store at MASTER_ADDR:MASTER_PORT
    pids = await launch_two_ranks(nats_server, job_dir, docker_engine.image, master.getsockname()[1])
    assert await wait_for(lambda: [e.get("in_place") for e in ledger(tmp_path)] == [True, True], timeout_s=60)

    first_agent.kill()  # the agent's process dies; its ranks' containers run on
    await first_agent.wait()
    roots = [*(Path(m.source) for m in python_mounts()), tmp_path]
    async with running_agent(
        nats_server, tmp_path, report_interval_s=0.1, docker_url=docker_engine.url, container_mount_roots=roots
    ) as harness:
        adopted = sorted(harness.agent.supervisor.ranks(), key=lambda r: r.rank)
        assert [(r.rank, r.handle.pid, r.alive, r.in_place) for r in adopted] == [
            (0, pids[0], True, True),
            (1, pids[1], True, True),
        ]
        assert harness.agent.supervisor.launches["job-1"].container is not None
        assert await wait_for(lambda: len(latest_steps(harness)) == 2, timeout_s=30)  # heartbeats at the new socket
        log_size = adopted[0].log_path.stat().st_size
        assert await wait_for(lambda: adopted[0].log_path.stat().st_size > log_size)  # output copied on

        os.kill(pids[1], signal.SIGKILL)
        assert await wait_for(lambda: harness.of_type(RankExited), timeout_s=30)
        stop = await harness.command(
            CommandAction.STOP, fence=1, command_id="s", grace_s=2.0, park_within_s=5.0, kill_ranks=[1]
        )
        assert stop.result is CommandResult.DONE and stop.data["parked"] == [0]  # ordered through its inbox
        done = await harness.command(CommandAction.STOP, fence=1, command_id="s2", grace_s=2.0)
        assert done.result is CommandResult.DONE and not adopted[0].alive
        exits = [e for e in harness.events if isinstance(e, RankExited)]  # once, as its own death, none lost
        assert [(e.rank, e.signal) for e in exits] == [(1, "SIGKILL")] and "lost with" not in exits[0].log_tail[-1]
    master.close()
    containers = docker.DockerClient(base_url=docker_engine.url).containers
    ours = {"label": "io.reprise.job=job-1"}  # each removed right after its exit was reported
    assert await wait_for(lambda: containers.list(all=True, sparse=True, filters=ours) == [], timeout_s=30)
