"""The Docker daemon SIGKILLed and restarted under a real agent whose job's rank runs in a container (a daemon of this
test's own, without live restore): the agent reports the dependency fault while the rank trains on; the restarted
daemon ends the rank's container, whose death the agent reports once (SIGKILL), and the job's relaunch (what the
orchestrator's recovery sends) runs its rank in a new container on the daemon that is back. An agent restarted while
its daemon is away cannot adopt: it kills its predecessor's containers from the host and reports their ranks lost."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from reprise_agent.launch.container_policy import ContainerPolicy
from reprise_agent.launch.containers import ContainerEngine
from reprise_agent.launch.processes import ProcessLauncher
from reprise_agent.ranks import RankProcess, RankSupervisor
from reprise_cli.dockerd import DockerDaemon, ensure_base_image
from reprise_cli.servers import NatsServer
from reprise_common.events import CommandAction, CommandResult, DependencyFailed, LaunchArgs, NodeReport, RankExited
from reprise_common.procs import process_alive

from ..test_agent import Harness, running_agent, wait_for
from .conftest import PYTHON, Engine, python_mounts
from .test_agent_adoption import HEARTBEATS


async def launch(harness: Harness, image: str, job_dir: Path, *, epoch: int) -> int:
    mounts = [*(m.model_dump() for m in python_mounts()), {"source": str(job_dir), "target": str(job_dir)}]
    reply = await harness.command(
        CommandAction.LAUNCH, fence=1, command_id=f"l{epoch}", restart_epoch=epoch, world_size=1,
        master_addr="127.0.0.1", master_port=29500, command=[PYTHON, str(job_dir / "train.py")],
        container={"image": image, "mounts": mounts}, ranks=[{"rank": 0, "node_id": "n1", "gpu": 0, "local_rank": 0}],
    )  # fmt: skip
    assert reply.result is CommandResult.DONE, reply
    return int(reply.data["pids"][0])


def stepping(harness: Harness, epoch: int) -> bool:
    reports = [e for e in harness.events if isinstance(e, NodeReport)]
    return bool(reports) and any(r.restart_epoch == epoch and r.step for r in reports[-1].ranks)


async def test_a_daemon_killed_mid_job_is_reported_and_the_job_runs_again_once_it_is_back(
    nats_server: NatsServer, tmp_path: Path, docker_engine: Engine
) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "train.py").write_text(HEARTBEATS)
    daemon = DockerDaemon(tmp_path / "dockerd")
    daemon.start()
    roots = [*(Path(m.source) for m in python_mounts()), tmp_path]
    try:
        assert await asyncio.to_thread(ensure_base_image, daemon.url) == docker_engine.image  # from the cache
        async with running_agent(
            nats_server, tmp_path, report_interval_s=0.1, docker_url=daemon.url, container_mount_roots=roots,
            dependency_interval_s=0.2,
        ) as harness:  # fmt: skip
            pid = await launch(harness, docker_engine.image, job_dir, epoch=0)
            assert await wait_for(lambda: stepping(harness, 0), timeout_s=30)

            assert daemon.process is not None
            daemon.process.signal(signal.SIGKILL)
            assert await wait_for(lambda: harness.of_type(DependencyFailed), timeout_s=30)
            failed = [e for e in harness.events if isinstance(e, DependencyFailed)]
            assert {e.dependency for e in failed} == {"docker"} and failed[0].node_id == "n1"
            await asyncio.sleep(1.0)
            assert process_alive(pid) and not harness.of_type(RankExited)  # the rank trains on without its daemon

            await asyncio.to_thread(daemon.start)  # no live restore: it ends the containers it had
            assert await wait_for(lambda: harness.of_type(RankExited), timeout_s=60)
            relaunched = await launch(harness, docker_engine.image, job_dir, epoch=1)  # the recovery's relaunch
            assert relaunched != pid
            assert await wait_for(lambda: stepping(harness, 1), timeout_s=30)
            exits = [e for e in harness.events if isinstance(e, RankExited)]
            assert [(e.rank, e.restart_epoch, e.signal) for e in exits] == [(0, 0, "SIGKILL")]  # once
    finally:
        daemon.stop()


async def test_an_agent_restarted_while_its_daemon_is_down_ends_its_ranks_and_reports_them_lost(
    tmp_path: Path, docker_engine: Engine
) -> None:
    daemon = DockerDaemon(tmp_path / "dockerd")
    daemon.start()
    roots = (*(Path(m.source) for m in python_mounts()), tmp_path)
    engine = ContainerEngine(base_url=daemon.url, policy=ContainerPolicy(mount_roots=roots), timeout_s=2.0)

    async def on_exit(rank: RankProcess) -> None:
        pass

    try:
        assert await asyncio.to_thread(ensure_base_image, daemon.url) == docker_engine.image
        first = RankSupervisor(node_id="n1", state_dir=tmp_path / "agent", launcher=ProcessLauncher(),
                               on_exit=on_exit, containers=engine)  # fmt: skip
        spec = LaunchArgs.model_validate({
            "restart_epoch": 0, "world_size": 1, "master_addr": "127.0.0.1", "master_port": 29500,
            "command": [PYTHON, "-c", "import time; time.sleep(60)"],
            "container": {"image": docker_engine.image, "mounts": [m.model_dump() for m in python_mounts()]},
            "ranks": [{"rank": 0, "node_id": "n1", "local_rank": 0}],
        })  # fmt: skip
        pid = (await first.launch("job-1", spec))[0][0]
        assert daemon.process is not None
        daemon.process.signal(signal.SIGKILL)  # the daemon, then the agent's process, die

        second = RankSupervisor(node_id="n1", state_dir=tmp_path / "agent", launcher=ProcessLauncher(),
                                on_exit=on_exit, containers=engine)  # fmt: skip
        lost = await asyncio.to_thread(second.orphans)
        assert [(r.job_id, r.rank) for r in lost] == [("job-1", 0)] and second.ranks() == []
        assert await wait_for(lambda: not process_alive(pid), timeout_s=10)  # its init killed from the host
        assert await wait_for(lambda: not first.ranks()[0].alive, timeout_s=30)  # (the dead agent's threads end)
    finally:
        daemon.stop()
