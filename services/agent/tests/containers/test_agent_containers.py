"""A real agent runs a job's ranks in containers on a real dockerd: two ranks in a gloo group that train (heartbeats
through the mounted SDK socket), a rank SIGKILLed from the host reported as any rank's death, its survivor parked
and restarted in place in its own container (orders through the inbox), a missing image refused with the field
named, and an agent without a Docker daemon refusing a containerized job; a job without a spec still runs processes.
A restarted agent's supervisor adopts the containers its predecessor's ledger names as they run, and removes the
rest (test_agent_adoption.py: the same with a real agent process killed)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import docker
import pytest

from reprise_agent.launch.container_policy import ContainerPolicy
from reprise_agent.launch.containers import ContainerEngine
from reprise_agent.launch.processes import ProcessLauncher
from reprise_agent.ranks import RankProcess, RankSupervisor
from reprise_cli.servers import NatsServer, free_port
from reprise_common.events import CommandAction, CommandResult, LaunchArgs, NodeReport, RankExited

from ..test_agent import Harness, running_agent, wait_for
from .conftest import PYTHON, Engine, open_home, python_mounts

pytest.importorskip("torch", reason="PyTorch is not installed: containerized ranks train in a real gloo group")

TRAIN = """
import os, time
from datetime import timedelta
import torch, torch.distributed as dist
import reprise_sdk

def train(info):
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    print(f"enter epoch={info.restart_epoch} rank={info.rank} world={info.world_size}", flush=True)
    total, step = torch.ones(1), 0
    while True:
        dist.all_reduce(total)
        step += 1
        reprise_sdk.heartbeat(step)
        time.sleep(0.02)

reprise_sdk.run(train)
"""


@pytest.fixture
async def harness(nats_server: NatsServer, tmp_path: Path, docker_engine: Engine) -> AsyncIterator[Harness]:
    roots = [*(Path(m.source) for m in python_mounts()), tmp_path]
    async with running_agent(
        nats_server, tmp_path, report_interval_s=0.1, docker_url=docker_engine.url, container_mount_roots=roots
    ) as h:
        yield h


def container(image: str, job_dir: Path) -> dict[str, object]:
    mounts = [*(m.model_dump() for m in python_mounts()), {"source": str(job_dir), "target": str(job_dir)}]
    return {"image": image, "mounts": mounts, "memory_bytes": 2 * 2**30, "pids_limit": 512}


async def launch(harness: Harness, spec: dict[str, object], argv: list[str], *, epoch: int) -> list[int]:
    """Launch the job's two ranks of `epoch` in containers, on a free rendezvous port (host networking)."""
    reply = await harness.command(
        CommandAction.LAUNCH, fence=1, command_id=f"l{epoch}", restart_epoch=epoch, world_size=2,
        master_addr="127.0.0.1", master_port=free_port(), command=argv, container=spec,
        ranks=[{"rank": i, "node_id": "n1", "gpu": i, "local_rank": i} for i in range(2)],
    )  # fmt: skip
    assert reply.result is CommandResult.DONE, reply
    assert harness.agent.supervisor.launches["job-1"].container is not None
    return [int(pid) for pid in reply.data["pids"]]


def stepping(harness: Harness, epoch: int) -> bool:
    reports = [e for e in harness.events if isinstance(e, NodeReport)]
    return bool(reports) and len([r for r in reports[-1].ranks if r.restart_epoch == epoch and r.step]) == 2


async def kill_one_park_the_other(harness: Harness, pid: int) -> None:
    """SIGKILL rank 1 from the host, on the pid its report shows: rank 0 parks, and the stop leaves it parked."""
    os.kill(pid, signal.SIGKILL)
    assert await wait_for(lambda: any(r.parked.is_set() for r in harness.agent.supervisor.ranks()), timeout_s=60)
    stop = await harness.command(
        CommandAction.STOP, fence=1, command_id="s", grace_s=2.0, park_within_s=5.0, kill_ranks=[1]
    )
    assert stop.result is CommandResult.DONE and stop.data["parked"] == [0]


async def test_containerized_ranks_train_die_and_restart_in_place(
    harness: Harness, docker_engine: Engine, tmp_path: Path
) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "train.py").write_text(TRAIN)
    spec, argv = container(docker_engine.image, job_dir), [PYTHON, str(job_dir / "train.py")]
    pids = await launch(harness, spec, argv, epoch=0)
    assert await wait_for(lambda: stepping(harness, 0), timeout_s=90)  # heartbeats over the mounted SDK socket
    assert await wait_for(lambda: all(r.in_place for r in harness.agent.supervisor.ranks()))

    await kill_one_park_the_other(harness, pids[1])
    assert await wait_for(lambda: harness.of_type(RankExited), timeout_s=30)
    exits = [e for e in harness.events if isinstance(e, RankExited)]
    assert [(e.rank, e.signal, e.oom_killed) for e in exits] == [(1, "SIGKILL", False)]

    relaunched = await launch(harness, spec, argv, epoch=1)
    assert relaunched[0] == pids[0] and relaunched[1] != pids[1]  # rank 0 in its own container, ordered by inbox
    assert await wait_for(lambda: stepping(harness, 1), timeout_s=90)


async def test_a_missing_image_fails_the_launch_naming_the_field(harness: Harness, tmp_path: Path) -> None:
    reply = await harness.launch(
        fence=1, command_id="l", container={"image": "team/absent:1", "mounts": []}, command=[PYTHON, "-c", "pass"]
    )
    assert reply.result is CommandResult.FAILED
    assert "container.image 'team/absent:1' is not on this node" in reply.detail
    assert harness.agent.supervisor.ranks() == []


async def test_an_agent_without_docker_refuses_a_containerized_job_and_runs_processes(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    async with running_agent(nats_server, tmp_path, report_interval_s=0.1) as harness:
        refused = await harness.launch(fence=1, command_id="c", container={"image": "team/train:1"})
        assert refused.result is CommandResult.FAILED and "no REPRISE_DOCKER_URL" in refused.detail
        processes = await harness.launch(fence=1, command_id="p")
        assert processes.result is CommandResult.DONE
        assert all(r.handle.record().keys() == {"pid", "started"} for r in harness.agent.supervisor.ranks())


async def test_a_restarted_agents_supervisor_adopts_what_runs_as_recorded_and_removes_the_rest(
    docker_engine: Engine, tmp_path: Path
) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    roots = (*(Path(m.source) for m in python_mounts()), tmp_path)
    engine = ContainerEngine(base_url=docker_engine.url, policy=ContainerPolicy(mount_roots=roots))

    async def on_exit(rank: RankProcess) -> None:
        exited.append(rank.rank)

    exited: list[int] = []
    first = RankSupervisor(node_id="n1", state_dir=tmp_path / "agent", launcher=ProcessLauncher(), on_exit=on_exit,
                           containers=engine)  # fmt: skip
    spec = LaunchArgs.model_validate({
        "restart_epoch": 0, "world_size": 1, "master_addr": "127.0.0.1", "master_port": free_port(),
        "command": [PYTHON, "-c", "import time; time.sleep(60)"], "container": container(docker_engine.image, job_dir),
        "ranks": [{"rank": 0, "node_id": "n1", "local_rank": 0}],
    })  # fmt: skip
    for job in ("job-1", "job-2", "job-3"):
        await first.launch(job, spec)
    running, changed, unrecorded = first.ranks()
    kept, stranger = json.loads(first.ledger.read_text())[:2]
    stranger["started"] -= 1  # the ledger's rank is not the process that container runs now
    first.ledger.write_text(json.dumps([kept, stranger]))  # it died before writing job-3
    client = docker.DockerClient(base_url=docker_engine.url)
    assert client.containers.get(running.handle.record()["container_id"]).labels["io.reprise.node"] == "n1"

    # The agent's process dies here (its ranks' containers outlive it); the next one reads its ledger.
    second = RankSupervisor(node_id="n1", state_dir=tmp_path / "agent", launcher=ProcessLauncher(), on_exit=on_exit,
                            containers=engine)  # fmt: skip
    lost = second.orphans()
    assert [(r.job_id, r.rank, r.restart_epoch) for r in lost] == [("job-2", 0, 0)]
    assert [(r.job_id, r.handle.pid, r.alive) for r in second.ranks()] == [("job-1", running.handle.pid, True)]
    assert second.launches["job-1"] == spec
    assert [e["job_id"] for e in json.loads(second.ledger.read_text())] == ["job-1"]
    for gone in (changed, unrecorded):  # by the ledger, and by the label
        with pytest.raises(docker.errors.NotFound):
            client.containers.get(gone.handle.record()["container_id"])
    assert await wait_for(lambda: not changed.alive and not unrecorded.alive, timeout_s=30)
    await second.stop("job-1", grace_s=2.0)
    assert [r.handle.returncode for r in second.ranks()] == [-signal.SIGTERM]  # the adopted rank, stopped


async def test_a_rank_in_a_container_of_a_non_root_user_trains_and_restarts_in_place(
    harness: Harness, docker_engine: Engine, tmp_path: Path
) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir(mode=0o755)
    (job_dir / "train.py").write_text(TRAIN)
    spec, argv = {**container(docker_engine.image, job_dir), "user": "1000:1000"}, [PYTHON, str(job_dir / "train.py")]
    spec["mounts"] = [*spec["mounts"], open_home(tmp_path).model_dump()]  # type: ignore[list-item]
    pids = await launch(harness, spec, argv, epoch=0)
    assert all(os.stat(f"/proc/{pid}").st_uid == 1000 for pid in pids)
    assert await wait_for(lambda: stepping(harness, 0), timeout_s=90)  # its heartbeats reach the agent's socket
    assert await wait_for(lambda: all(r.in_place for r in harness.agent.supervisor.ranks()))  # its inbox is bound

    await kill_one_park_the_other(harness, pids[1])
    relaunched = await launch(harness, spec, argv, epoch=1)
    assert relaunched[0] == pids[0] and relaunched[1] != pids[1]
    assert await wait_for(lambda: stepping(harness, 1), timeout_s=90)
