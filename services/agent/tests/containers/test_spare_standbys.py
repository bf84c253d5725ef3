"""A spare's standby containers of a job it never ran, on a real dockerd through a real agent: told by a
PrepareStandbysCommand, the agent keeps a container of the job's image waiting (listed in its node report like a
process standby), a repeated command keeps that one, a rank of the job moved here starts on it, and a drop removes
them; the orchestrator's agents backend sends it to the pool's spares with a containerized job's launch, and the drop
at its end. The command refuses unknown fields; a keep names the job's image and command, a drop needs neither."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import docker
import docker.errors
import pydantic
import pytest

from reprise_agent.launch.containers import ContainerEngine
from reprise_cli.servers import NatsServer, free_port
from reprise_common import subjects
from reprise_common.clock import SystemClock
from reprise_common.events import (
    CommandAction,
    CommandResult,
    ContainerSpec,
    LaunchArgs,
    LaunchReply,
    NodeReport,
    PrepareStandbysArgs,
    RankAssignment,
    Wire,
    parse_command,
)
from reprise_orchestrator.compute.agents.backend import AgentsBackend
from reprise_orchestrator.compute.backend import LaunchRequest
from reprise_orchestrator.inventory import Inventory

from ..test_agent import Harness, running_agent, wait_for
from .conftest import PYTHON, Engine, python_mounts
from .test_agent_containers import container

SCRIPT = "import os, sys, time\nprint('rank', os.environ['RANK'], 'wave' in sys.modules, flush=True)\ntime.sleep(30)\n"


def standbys(client: docker.DockerClient) -> list[str]:
    """The standby containers of job-1 (sparse: another test's being removed meanwhile is no error)."""
    found = client.containers.list(all=True, sparse=True, filters={"label": ["io.reprise.rank=standby"]})
    return [c.id for c in found if c.attrs.get("Labels", {}).get("io.reprise.job") == "job-1"]


@pytest.fixture(autouse=True)
def no_stray_standbys(docker_engine: Engine) -> None:
    """Remove standbys an earlier test's agent left while creating them (its successor's sweep would)."""
    client = docker.DockerClient(base_url=docker_engine.url)
    for stray in client.containers.list(all=True, sparse=True, filters={"label": ["io.reprise.rank=standby"]}):
        with contextlib.suppress(docker.errors.NotFound):
            stray.remove(force=True)


@contextlib.asynccontextmanager
async def spare_agent(
    nats_server: NatsServer, tmp_path: Path, engine: Engine, *, standbys: int, preload: list[str], refill_delay_s: float
) -> AsyncIterator[Harness]:
    """A spare's real agent on the session's dockerd, whose containers may mount the checkout and `tmp_path`."""
    roots = [*(Path(m.source) for m in python_mounts()), tmp_path]
    async with running_agent(
        nats_server, tmp_path, report_interval_s=0.1, docker_url=engine.url, container_mount_roots=roots,
        standbys=standbys, standby_preload=preload, standby_refill_delay_s=refill_delay_s, spare=True,
    ) as harness:  # fmt: skip
        yield harness


def ready_in_report(harness: Harness, pid: int) -> bool:
    reports = [e for e in harness.events if isinstance(e, NodeReport)]
    return bool(reports) and any(s.pid == pid and s.ready for s in reports[-1].standbys)


async def test_a_spare_keeps_a_standby_container_of_a_job_it_never_ran(
    nats_server: NatsServer, tmp_path: Path, docker_engine: Engine
) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "rank.py").write_text(SCRIPT)
    client = docker.DockerClient(base_url=docker_engine.url)
    async with spare_agent(
        nats_server, tmp_path, docker_engine, standbys=1, preload=["wave"], refill_delay_s=0.0
    ) as harness:
        spec, argv = container(docker_engine.image, job_dir), [PYTHON, str(job_dir / "rank.py")]
        order = {"container": spec, "command": argv, "env": {"WHO": "me"}, "cwd": str(job_dir), "hold_s": 600}
        reply = await harness.command(CommandAction.PREPARE_STANDBYS, fence=1, command_id="p1", **order)
        assert reply.result is CommandResult.DONE and reply.data["standbys"] == 1, reply
        engine = harness.agent.supervisor.containers
        assert isinstance(engine, ContainerEngine)
        assert await wait_for(lambda: engine.standbys.ready("job-1") == 1, timeout_s=120)
        [waiting] = standbys(client)
        [pid] = [s.pid for s in engine.standbys.statuses()]
        assert await wait_for(lambda: ready_in_report(harness, pid), timeout_s=10)  # as a process standby is listed

        again = await harness.command(CommandAction.PREPARE_STANDBYS, fence=1, command_id="p1", **order)
        renewed = await harness.command(CommandAction.PREPARE_STANDBYS, fence=1, command_id="p2", **order)
        assert again.duplicate and renewed.result is CommandResult.DONE
        assert standbys(client) == [waiting]  # idempotent: the same one waits

        moved = await harness.command(
            CommandAction.LAUNCH, fence=1, command_id="l1", restart_epoch=1, world_size=2, master_addr="127.0.0.1",
            master_port=free_port(), command=argv, env={"WHO": "me"}, cwd=str(job_dir), container=spec,
            ranks=[{"rank": 1, "node_id": "n1", "local_rank": 0}],
        )  # fmt: skip
        assert moved.result is CommandResult.DONE, moved
        [rank] = harness.agent.supervisor.ranks()
        assert rank.handle.warm and rank.handle.pid == pid  # the rank moved here started on the prepared standby
        assert await wait_for(lambda: "rank 1 True" in "".join(rank.tail), timeout_s=30)
        stop = await harness.command(CommandAction.STOP, fence=1, command_id="s1", grace_s=1.0)
        assert stop.result is CommandResult.DONE


async def test_a_spare_keeps_no_more_standbys_of_a_job_than_a_node_of_it_runs_ranks(
    nats_server: NatsServer, tmp_path: Path, docker_engine: Engine
) -> None:
    """More could never be taken at once (a node of the job moves here whole), and each one that waits holds an
    interpreter with the job's modules imported."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    client = docker.DockerClient(base_url=docker_engine.url)
    async with spare_agent(
        nats_server, tmp_path, docker_engine, standbys=3, preload=["wave"], refill_delay_s=60.0
    ) as harness:
        # The refill delay lets a node's ranks that just started import first: a spare has none, it starts at once.
        spec, argv = container(docker_engine.image, job_dir), [PYTHON, str(job_dir / "rank.py")]
        order = {"container": spec, "command": argv, "cwd": str(job_dir), "ranks_per_node": 2}
        reply = await harness.command(CommandAction.PREPARE_STANDBYS, fence=1, command_id="p1", **order)
        assert reply.result is CommandResult.DONE and reply.data["standbys"] == 2, reply
        engine = harness.agent.supervisor.containers
        assert isinstance(engine, ContainerEngine)
        assert await wait_for(lambda: engine.standbys.ready("job-1") == 2, timeout_s=30)
        await asyncio.sleep(2.0)  # a third would be on its way by now
        assert len(standbys(client)) == 2


async def test_a_spare_drops_a_jobs_standbys_when_told(
    nats_server: NatsServer, tmp_path: Path, docker_engine: Engine
) -> None:
    client = docker.DockerClient(base_url=docker_engine.url)
    async with spare_agent(nats_server, tmp_path, docker_engine, standbys=1, preload=[], refill_delay_s=0.0) as harness:
        order = {"container": container(docker_engine.image, tmp_path), "command": [PYTHON, "train.py"]}
        reply = await harness.command(CommandAction.PREPARE_STANDBYS, fence=1, command_id="p1", **order)
        assert reply.result is CommandResult.DONE and reply.data["standbys"] == 1
        assert await wait_for(lambda: len(standbys(client)) == 1, timeout_s=60)
        stale = await harness.command(CommandAction.PREPARE_STANDBYS, fence=0, command_id="p0", **order)
        assert stale.result is CommandResult.REJECTED_STALE_FENCE
        dropped = await harness.command(CommandAction.PREPARE_STANDBYS, fence=1, command_id="d1", order="drop", **order)
        assert dropped.result is CommandResult.DONE and dropped.data["standbys"] == 0
        assert await wait_for(lambda: standbys(client) == [], timeout_s=30)


async def test_an_agent_without_docker_refuses_to_prepare_standbys(nats_server: NatsServer, tmp_path: Path) -> None:
    async with running_agent(nats_server, tmp_path, report_interval_s=0.1, spare=True) as harness:
        order = {"container": {"image": "python:3.11-slim"}, "command": [PYTHON, "train.py"]}
        reply = await harness.command(CommandAction.PREPARE_STANDBYS, fence=1, command_id="p1", **order)
        assert reply.result is CommandResult.FAILED and "REPRISE_DOCKER_URL" in reply.detail


def test_the_order_refuses_unknown_fields_and_unbounded_holds() -> None:
    base = {"container": {"image": "python:3.11-slim"}, "command": ["python", "train.py"]}
    assert PrepareStandbysArgs.model_validate(base).hold_s == 3600.0
    with pytest.raises(pydantic.ValidationError, match="extra"):
        PrepareStandbysArgs.model_validate({**base, "surprise": 1})
    with pytest.raises(pydantic.ValidationError, match="hold_s"):
        PrepareStandbysArgs.model_validate({**base, "hold_s": 10**6})
    assert PrepareStandbysArgs.model_validate({"order": "drop"}).container is None  # a drop names only the job
    with pytest.raises(pydantic.ValidationError, match="required to keep"):
        PrepareStandbysArgs.model_validate({"command": ["python", "train.py"]})


async def test_a_containerized_launch_tells_the_pools_spares_to_keep_standbys(
    nats_server: NatsServer, tmp_path: Path, docker_engine: Engine
) -> None:
    roots = [*(Path(m.source) for m in python_mounts()), tmp_path]
    client = docker.DockerClient(base_url=docker_engine.url)
    async with running_agent(
        nats_server, tmp_path, report_interval_s=0.1, docker_url=docker_engine.url, container_mount_roots=roots,
        standbys=1, standby_preload=[], standby_refill_delay_s=0.0, spare=True,
    ) as harness:  # fmt: skip
        inventory = Inventory(clock=SystemClock(), stale_s=30.0)
        inventory.observe("n1", await harness.agent.reporter.report())  # the spare, as its report says
        backend = AgentsBackend(
            bus=harness.client, inventory=inventory, command_timeout_s=5.0, stop_grace_s=1.0, prepare_wait_s=0.5
        )  # w1's rank reports no step: the spare is told after 0.5 s

        async def worker(data: bytes) -> Wire:  # the job's node: it launches (the rank itself does not matter here)
            command = parse_command(data)
            return LaunchReply(command_id=command.command_id, node_id="w1", result=CommandResult.DONE)

        await harness.client.serve(subjects.node_command("w1"), worker)
        spec = ContainerSpec.model_validate(container(docker_engine.image, tmp_path))
        args = LaunchArgs(
            restart_epoch=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(),
            command=[PYTHON, "train.py"], container=spec,
            ranks=[RankAssignment(rank=0, node_id="w1", local_rank=0)],
        )  # fmt: skip
        answers = await backend.launch(LaunchRequest(job_id="job-1", args=args), operation_id="op-1", fence=1)
        assert answers.all_done  # the launch's own answer, not waiting for the spare's
        assert await wait_for(lambda: len(standbys(client)) == 1, timeout_s=60)  # the spare keeps one of the job
        await backend.drop_standbys("job-1", operation_id="op-1:end", fence=1)  # the job ended
        assert await wait_for(lambda: standbys(client) == [], timeout_s=30)
        await backend.close()
