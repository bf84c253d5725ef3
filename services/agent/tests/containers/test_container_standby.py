"""Warm standbys in containers on a real dockerd: after a job's launch a container of its image waits with the modules
imported; a relaunched rank runs on it as in a container of its own (its environment, directory, arguments, exit code,
output from its first line), the pool refills, a command that cannot run on one starts cold, and closing the engine
removes what waits. Through a real agent: a rank of a gloo job SIGKILLed, its peer restarted in place, and its
replacement started on the job's standby container, both training again."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import docker
import pytest

from reprise_agent.agent import Agent
from reprise_agent.launch import container_standby
from reprise_agent.launch.container_cpu import LEAST, cgroup_cpu_file
from reprise_agent.launch.container_procs import rank_pid
from reprise_agent.launch.container_standby import ContainerStandbys
from reprise_agent.launch.containers import ContainerEngine
from reprise_agent.settings import AgentSettings
from reprise_cli.servers import NatsServer
from reprise_common.bus import Bus
from reprise_common.events import ContainerMount

from ..test_agent import running_agent, wait_for
from .conftest import PYTHON, Engine, open_home, python_mounts
from .test_agent_containers import TRAIN, container, kill_one_park_the_other, launch, stepping
from .test_container_launcher import ENV, engine_for, job

SCRIPT = """
import os, sys
print(os.environ["RANK"], os.environ["WHO"], os.getcwd(), sys.argv[1:], "wave" in sys.modules,
      os.environ.get("REPRISE_STANDBY_FIFO"), "PATH" in os.environ, os.sched_getscheduler(0), flush=True)
sys.exit(3)
"""

DOCKER_DEFAULT_WEIGHT = {"cpu.shares": "1024", "cpu.weight": "100"}  # a container made without CPU settings


def standbys(client: docker.DockerClient) -> list[str]:
    return [c.id for c in client.containers.list(all=True, sparse=True, filters={"label": "io.reprise.rank=standby"})]


async def none_left(client: docker.DockerClient) -> bool:
    """No standby container of an earlier test is left: one a rank ran on is removed REMOVE_AFTER_S after its exit."""
    return await wait_for(lambda: standbys(client) == [], timeout_s=30)


@pytest.mark.parametrize(("user", "uid"), [(None, 0), ("nobody", 65534)])  # a name of the image's
async def test_a_relaunched_rank_runs_on_a_warm_container_as_in_its_own(
    docker_engine: Engine, tmp_path: Path, user: str | None, uid: int
) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "rank.py").write_text(SCRIPT)
    engine = engine_for(docker_engine, tmp_path)
    engine.standbys = ContainerStandbys(size=1, preload=["wave"])  # a module nothing else imports
    mounts = [*python_mounts(), ContainerMount(source=str(job_dir), target=str(job_dir))]
    mounts += [open_home(tmp_path)] if user else []  # of a user other than root: a FIFO and output file it may open
    launcher = engine.for_job(job(docker_engine.image, mounts=mounts, user=user))
    env = {**ENV, "REPRISE_SDK_INBOX_DIR": str(tmp_path / "inbox"), "WHO": "me"}
    client = docker.DockerClient(base_url=docker_engine.url)
    assert await none_left(client)
    try:
        first = await launcher.start([PYTHON, "-c", "print('cold')"], env=env, cwd=None, warm=False)
        assert not first.warm and await asyncio.wait_for(first.wait(), 30) == 0
        assert await wait_for(lambda: engine.standbys.ready("job-1") == 1, timeout_s=60)
        [waiting] = standbys(client)
        init_pid = client.containers.get(waiting).attrs["State"]["Pid"]
        assert os.sched_getscheduler(rank_pid(init_pid)) == os.SCHED_IDLE  # it waits at idle priority
        weight = cgroup_cpu_file(init_pid)  # and its container at the least CPU weight beside the ranks'
        assert weight is not None and weight.read_text().strip() == LEAST[weight.name]

        rank = await launcher.start(
            [PYTHON, str(job_dir / "rank.py"), "--lr", "0.1"], env={**env, "RANK": "1"}, cwd=str(job_dir), warm=True
        )
        assert rank.warm and rank.container.id == waiting
        assert os.stat(f"/proc/{rank.pid}").st_uid == uid
        assert weight.read_text().strip() == DOCKER_DEFAULT_WEIGHT[weight.name]  # a rank's container's, as any other
        output = (await asyncio.wait_for(rank.output.read(), 30)).decode()
        assert output == f"1 me {job_dir} ['--lr', '0.1'] True None True {os.SCHED_OTHER}\n"  # its own only
        assert await asyncio.wait_for(rank.wait(), 30) == 3
        assert await wait_for(lambda: engine.standbys.ready("job-1") == 1, timeout_s=60)  # refilled
        assert standbys(client) != [waiting]

        cold = await launcher.start([PYTHON, "-c", "print('x')"], env=env, cwd=None, warm=True)
        assert not cold.warm  # interpreter options: not on a standby
        await asyncio.wait_for(cold.wait(), 30)
    finally:
        engine.close()
    assert await none_left(client)  # the waiting one at once, the one the rank ran on after it


async def test_an_agent_replaces_a_dead_containerized_rank_on_a_warm_container(
    nats_server: NatsServer, tmp_path: Path, docker_engine: Engine
) -> None:
    pytest.importorskip("torch", reason="PyTorch is not installed: the replaced rank trains in a real gloo group")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "train.py").write_text(TRAIN)
    roots = [*(Path(m.source) for m in python_mounts()), tmp_path]
    async with running_agent(
        nats_server, tmp_path, report_interval_s=0.1, docker_url=docker_engine.url, container_mount_roots=roots,
        standbys=1, standby_preload=["torch", "torch.distributed"], standby_refill_delay_s=0.0,
    ) as harness:  # fmt: skip
        spec, argv = container(docker_engine.image, job_dir), [PYTHON, str(job_dir / "train.py")]
        pids = await launch(harness, spec, argv, epoch=0)
        assert await wait_for(lambda: stepping(harness, 0), timeout_s=90)
        engine = harness.agent.supervisor.containers
        assert isinstance(engine, ContainerEngine)
        assert await wait_for(lambda: engine.standbys.ready("job-1") == 1, timeout_s=120)

        await kill_one_park_the_other(harness, pids[1])
        relaunched = await launch(harness, spec, argv, epoch=1)
        replaced = next(r for r in harness.agent.supervisor.ranks() if r.rank == 1)
        assert relaunched[0] == pids[0] and replaced.handle.warm  # in place, and on the standby container
        assert await wait_for(lambda: stepping(harness, 1), timeout_s=90)  # heartbeats, a gloo group again


async def test_a_jobs_standbys_are_removed_once_none_of_its_ranks_runs_here(
    docker_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(container_standby, "RETIRE_AFTER_S", 1.0)
    monkeypatch.setattr(container_standby, "CHECK_S", 0.2)
    engine = engine_for(docker_engine, tmp_path)
    engine.standbys = ContainerStandbys(size=1, preload=[])
    env = {**ENV, "REPRISE_SDK_INBOX_DIR": str(tmp_path / "inbox")}
    client = docker.DockerClient(base_url=docker_engine.url)
    assert await none_left(client)
    try:
        launcher = engine.for_job(job(docker_engine.image))
        rank = await launcher.start([PYTHON, "-c", "import time; time.sleep(2)"], env=env, cwd=None, warm=False)
        assert await wait_for(lambda: engine.standbys.ready("job-1") == 1, timeout_s=60)
        assert len(standbys(client)) == 1 and rank.returncode is None  # kept while its rank runs
        assert await asyncio.wait_for(rank.wait(), 30) == 0
        assert await wait_for(lambda: standbys(client) == [], timeout_s=30)  # the job is over here
        assert engine.standbys.ready("job-1") == 0
    finally:
        engine.close()


@pytest.mark.parametrize(("standbys", "containers", "kept"), [(2, None, 2), (0, 2, 2), (2, 0, 0)])
def test_an_agent_keeps_as_many_standby_containers_as_its_settings_say(
    tmp_path: Path, standbys: int, containers: int | None, kept: int
) -> None:
    settings = AgentSettings(
        node_id="n1", state_dir=tmp_path, docker_url="unix:///nowhere.sock", standbys=standbys,
        container_standbys=containers,
    )  # fmt: skip
    engine = Agent(settings, Bus(url="nats://127.0.0.1:1", service="agent-n1")).supervisor.containers
    assert isinstance(engine, ContainerEngine) and engine.standbys.size == kept
