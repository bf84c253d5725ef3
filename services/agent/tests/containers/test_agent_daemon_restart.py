"""The Docker daemon SIGKILLed and restarted under a real agent whose job's rank runs in a container (a daemon of this
test's own, without live restore): the agent reports the dependency fault while the rank trains on; the restarted
daemon ends the rank's container, whose death the agent reports once, and the job's relaunch (what the
orchestrator's recovery sends) runs its rank in a new container on the daemon that is back. An agent restarted while
its daemon is away cannot adopt: it kills its predecessor's containers from the host and reports their ranks lost.
With live restore the rank trains on through the restart: its output is taken up after the last line copied (none
lost, none twice) and its exit is reported once, with its own code, also when it ends while the daemon is away."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from reprise_agent.launch import container_handle, kernel_exits
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


def rank_log(root: Path) -> list[str]:
    """The lines of rank 0's log of epoch 0, wherever under `root` the agent keeps it."""
    [log] = root.glob("**/epoch-0-rank-0.log")
    return log.read_text().splitlines()


def stepping(harness: Harness, epoch: int) -> bool:
    reports = [e for e in harness.events if isinstance(e, NodeReport)]
    return bool(reports) and any(r.restart_epoch == epoch and r.step for r in reports[-1].ranks)


@contextlib.asynccontextmanager
async def daemon_killed_under_a_rank(
    nats_server: NatsServer, tmp_path: Path, engine: Engine, script: str, *, live_restore: bool
) -> AsyncIterator[tuple[Harness, DockerDaemon, Path, int]]:
    """A real agent's rank stepping in a container of a daemon of the test's own, that daemon SIGKILLed and its
    dependency fault reported: the agent, the daemon (to start again), the job's directory, the rank's pid."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "train.py").write_text(script)
    daemon = DockerDaemon(tmp_path / "dockerd", live_restore=live_restore)
    daemon.start()
    roots = [*(Path(m.source) for m in python_mounts()), tmp_path]
    try:
        assert await asyncio.to_thread(ensure_base_image, daemon.url) == engine.image  # from the cache
        async with running_agent(
            nats_server, tmp_path, report_interval_s=0.1, docker_url=daemon.url, container_mount_roots=roots,
            dependency_interval_s=0.2,
        ) as harness:  # fmt: skip
            pid = await launch(harness, engine.image, job_dir, epoch=0)
            assert await wait_for(lambda: stepping(harness, 0), timeout_s=30)
            assert daemon.process is not None
            daemon.process.signal(signal.SIGKILL)
            assert await wait_for(lambda: harness.of_type(DependencyFailed), timeout_s=30)
            failed = [e for e in harness.events if isinstance(e, DependencyFailed)]
            assert {e.dependency for e in failed} == {"docker"} and failed[0].node_id == "n1"
            await asyncio.sleep(1.0)  # its output meanwhile waits in the container's pipe
            assert process_alive(pid) and not harness.of_type(RankExited)  # the rank trains on without its daemon
            yield harness, daemon, job_dir, pid
    finally:
        daemon.stop()


async def test_a_daemon_killed_mid_job_is_reported_and_the_job_runs_again_once_it_is_back(
    nats_server: NatsServer, tmp_path: Path, docker_engine: Engine
) -> None:
    async with daemon_killed_under_a_rank(nats_server, tmp_path, docker_engine, HEARTBEATS, live_restore=False) as (
        harness,
        daemon,
        job_dir,
        pid,
    ):
        await asyncio.to_thread(daemon.start)  # no live restore: it ends the containers it had
        assert await wait_for(lambda: harness.of_type(RankExited), timeout_s=60)
        relaunched = await launch(harness, docker_engine.image, job_dir, epoch=1)  # the recovery's relaunch
        assert relaunched != pid
        assert await wait_for(lambda: stepping(harness, 1), timeout_s=30)
        exits = [e for e in harness.events if isinstance(e, RankExited)]
        assert [(e.rank, e.restart_epoch) for e in exits] == [(0, 0)]  # once
        # The daemon's stop (SIGTERM) when it answered before the init's end was seen; else a kill, as far as anyone
        # could tell then.
        assert exits[0].signal in ("SIGTERM", "SIGKILL"), exits


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


UNTIL_TOLD = """
import os, time, reprise_sdk

def train(info):
    step = 0
    while not os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), "stop")):
        step += 1
        reprise_sdk.heartbeat(step)
        print(f"step {step}", flush=True)
        time.sleep(0.05)
    print("told to stop", flush=True)
    os._exit(3)

reprise_sdk.run(train)
"""


async def test_with_live_restore_the_rank_trains_through_a_daemon_restart_with_its_output_and_exit_its_own(
    nats_server: NatsServer, tmp_path: Path, docker_engine: Engine
) -> None:
    async with daemon_killed_under_a_rank(nats_server, tmp_path, docker_engine, UNTIL_TOLD, live_restore=True) as (
        harness,
        daemon,
        job_dir,
        pid,
    ):
        await asyncio.to_thread(daemon.start)  # live restore: it takes the running container up again
        await asyncio.sleep(2.0)
        assert process_alive(pid) and not harness.of_type(RankExited)  # it trains on under the daemon back
        (job_dir / "stop").touch()
        assert await wait_for(lambda: harness.of_type(RankExited), timeout_s=30)
        exits = [e for e in harness.events if isinstance(e, RankExited)]
        assert [(e.rank, e.exit_code, e.signal) for e in exits] == [(0, 3, None)]  # its own code, not a kill

    lines = rank_log(tmp_path)
    steps = [int(line.split()[1]) for line in lines if line.startswith("step ")]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > 60, lines[:5]  # none lost, none twice
    assert lines[-1] == "told to stop"


async def test_a_rank_that_ends_while_its_daemon_is_away_is_reported_at_once_with_its_code_and_last_output(
    nats_server: NatsServer, tmp_path: Path, docker_engine: Engine
) -> None:
    """The kernel's word of its container's exit and its output file need no daemon (docs/containers.md, "Exit and
    output")."""
    killed = daemon_killed_under_a_rank(nats_server, tmp_path, docker_engine, UNTIL_TOLD, live_restore=True)
    async with killed as (harness, _daemon, job_dir, _pid):
        (job_dir / "stop").touch()  # the daemon stays away: nothing of this exit can come from it
        assert await wait_for(lambda: harness.of_type(RankExited), timeout_s=30)
        [exited] = harness.of_type(RankExited)
        assert (exited.rank, exited.exit_code, exited.signal) == (0, 3, None)  # its own code, not a kill
        assert exited.log_tail[-1] == "told to stop"


async def test_without_the_kernels_word_a_rank_that_ends_while_its_daemon_is_away_waits_for_the_daemons(
    nats_server: NatsServer, tmp_path: Path, docker_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent the kernel does not tell exits (no CAP_NET_ADMIN): with live restore, the rank's status waits for the
    daemon back (within EXIT_WORD_S), and is its own code, not a kill."""
    monkeypatch.setattr(kernel_exits, "shared", lambda: None)
    # The daemon's start may take longer than the handle's usual wait for its word on a loaded host.
    monkeypatch.setattr(container_handle, "EXIT_WORD_S", 60.0)
    async with daemon_killed_under_a_rank(nats_server, tmp_path, docker_engine, UNTIL_TOLD, live_restore=True) as (
        harness,
        daemon,
        job_dir,
        pid,
    ):
        (job_dir / "stop").touch()
        assert await wait_for(lambda: not process_alive(pid), timeout_s=30)  # it ended while the daemon was away
        await asyncio.sleep(0.5)
        assert not harness.of_type(RankExited)  # not taken for a kill: its status waits for the daemon's word
        await asyncio.to_thread(daemon.start)  # live restore: it reads the container's status from its shim
        assert await wait_for(lambda: harness.of_type(RankExited), timeout_s=30)
        exits = [e for e in harness.events if isinstance(e, RankExited)]
        assert [(e.rank, e.exit_code, e.signal) for e in exits] == [(0, 3, None)]  # its own code, not a kill


async def test_a_rank_killed_while_its_daemon_is_away_dies_at_once(
    nats_server: NatsServer, tmp_path: Path, docker_engine: Engine
) -> None:
    """The kill goes to the container's init from the host (asking the daemon held the agent's loop for its round
    trip, and with the daemon away it killed nothing)."""
    async with daemon_killed_under_a_rank(nats_server, tmp_path, docker_engine, UNTIL_TOLD, live_restore=True) as (
        harness,
        daemon,
        _job_dir,
        pid,
    ):
        [rank] = harness.agent.supervisor.ranks()
        harness.agent.supervisor.kill(rank)
        assert await wait_for(lambda: not process_alive(pid), timeout_s=10)
        await asyncio.to_thread(daemon.start)
        assert await wait_for(lambda: harness.of_type(RankExited), timeout_s=30)
        exits = [e for e in harness.events if isinstance(e, RankExited)]
        assert [(e.rank, e.exit_code, e.signal) for e in exits] == [(0, None, "SIGKILL")]
