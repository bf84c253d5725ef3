"""The Slurm adapter against a real Slurm cluster on this host (the session's, conftest.py): allocations, drains with a
reason, an admin's drain, requeue, cancel, a lost slurmd, and a controller that is gone or frozen."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from reprise_cli.slurm import SlurmCluster
from reprise_orchestrator.compute.slurm.cli import SlurmCli, SlurmError, SlurmUnavailableError, expand_hostlist
from reprise_orchestrator.compute.slurm.models import SlurmJob, SlurmJobState, SlurmNode, SlurmSubmission

from .slurm_waits import eventually

ONE_TASK_PER_NODE = "#!/bin/sh\nsrun sh -c 'echo \"$SLURM_PROCID $SLURMD_NODENAME\"; exec sleep 300'\n"


@pytest.fixture
def cli(slurm_cluster: SlurmCluster) -> SlurmCli:
    """The adapter on the session's cluster."""
    return SlurmCli(conf=slurm_cluster.conf_path)


async def running(cli: SlurmCli, job_id: int) -> SlurmJob:
    """The job once it runs (asserted)."""

    async def read() -> SlurmJob | None:
        return await cli.job(job_id)

    job = await eventually(read, lambda job: job is not None and job.state is SlurmJobState.RUNNING)
    assert job is not None and job.state is SlurmJobState.RUNNING, job
    return job


def as_admin(cluster: SlurmCluster, *argv: str) -> str:
    """Run a Slurm command as an admin at a shell would, outside the adapter; its output."""
    env = {**os.environ, **cluster.env}
    return subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=10).stdout


def sinfo_reasons(cluster: SlurmCluster) -> dict[str, str]:
    """What an admin sees in `sinfo -R`: each drained or down node's reason."""
    out = as_admin(cluster, "sinfo", "-R", "--noheader", "--format=%N|%E")
    return {name: reason for line in out.splitlines() for name, _, reason in [line.partition("|")]}


async def test_an_allocation_of_three_nodes_runs_one_task_on_each(cli: SlurmCli, tmp_path: Path) -> None:
    output = tmp_path / "job.out"
    job_id = await cli.submit(SlurmSubmission(name="ddp demo", nodes=3, script=ONE_TASK_PER_NODE, output=output))

    job = await running(cli, job_id)
    assert job.name == "ddp demo" and len(set(job.nodes)) == 3
    assert set(job.nodes) <= {node.name for node in await cli.nodes()}
    deadline = time.monotonic() + 15
    while len(output.read_text().splitlines() if output.exists() else []) < 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    tasks = dict(line.split() for line in output.read_text().splitlines())
    assert sorted(tasks) == ["0", "1", "2"] and set(tasks.values()) == set(job.nodes)  # one rank per allocated node
    assert all("ALLOCATED" in node.state for node in await cli.nodes() if node.name in job.nodes)


async def test_a_drain_carries_its_reason_to_sinfo_and_a_resume_lifts_it(
    cli: SlurmCli, slurm_cluster: SlurmCluster
) -> None:
    reason = "reprise incident inc-7f3a: GPU XID 79 (fallen off the bus)"
    await cli.drain("node2", reason=reason)

    node = await cli.node("node2")
    assert node.drained and not node.schedulable and node.reason == reason
    assert sinfo_reasons(slurm_cluster)["node2"] == reason

    await cli.resume("node2")
    node = await eventually(lambda: cli.node("node2"), lambda node: node.schedulable)
    assert node.schedulable and not node.drained and node.reason == ""
    assert "node2" not in sinfo_reasons(slurm_cluster)


async def test_a_node_an_admin_drained_is_reported_drained(cli: SlurmCli, slurm_cluster: SlurmCluster) -> None:
    as_admin(slurm_cluster, "scontrol", "update", "NodeName=node4", "State=DRAIN", "Reason=admin: DIMM errors, #4411")

    node = await cli.node("node4")
    assert node.drained and not node.schedulable
    assert (node.reason, node.reason_set_by) == ("admin: DIMM errors, #4411", "root")
    assert [n.name for n in await cli.nodes() if not n.schedulable] == ["node4"]


async def test_a_requeued_job_waits_to_run_again(cli: SlurmCli, tmp_path: Path) -> None:
    job_id = await cli.submit(
        SlurmSubmission(name="requeue me", nodes=2, script=ONE_TASK_PER_NODE, output=tmp_path / "%j.out")
    )
    await running(cli, job_id)

    await cli.requeue(job_id)

    job = await eventually(lambda: cli.job(job_id), lambda job: job is not None and job.state is SlurmJobState.PENDING)
    assert job is not None and job.state is SlurmJobState.PENDING and job.restart_count == 1 and job.nodes == ()


async def test_a_job_requeued_without_a_node_runs_again_elsewhere(cli: SlurmCli, tmp_path: Path) -> None:
    job_id = await cli.submit(
        SlurmSubmission(name="shrink", nodes=3, script=ONE_TASK_PER_NODE, output=tmp_path / "%j.out")
    )
    first = await running(cli, job_id)
    lost = first.nodes[0]

    await cli.requeue(job_id, exclude=[lost])

    again = await running(cli, job_id)  # after the cluster's requeue delay (cred_expire, 10 s here)
    assert again.restart_count == 1 and again.excluded_nodes == (lost,)
    assert len(again.nodes) == 3 and lost not in again.nodes


async def test_a_cancelled_job_ends_and_frees_its_nodes(cli: SlurmCli, tmp_path: Path) -> None:
    job_id = await cli.submit(
        SlurmSubmission(name="cancel me", nodes=2, script=ONE_TASK_PER_NODE, output=tmp_path / "%j.out")
    )
    nodes = (await running(cli, job_id)).nodes

    await cli.cancel(job_id)

    job = await cli.job(job_id)
    assert job is not None and job.state in {SlurmJobState.CANCELLED, SlurmJobState.COMPLETING}

    def freed(all_nodes: list[SlurmNode]) -> bool:
        return all(node.state == {"IDLE"} for node in all_nodes if node.name in nodes)

    assert freed(await eventually(cli.nodes, freed))
    await cli.cancel(job_id)  # again: nothing to do, no error


async def test_a_lost_slurmd_is_seen_not_responding_then_down(cli: SlurmCli, slurm_cluster: SlurmCluster) -> None:
    slurm_cluster.kill_node("node5")

    node = await eventually(lambda: cli.node("node5"), lambda node: node.down, timeout_s=45)
    assert "NOT_RESPONDING" in node.state and not node.schedulable
    node = await eventually(lambda: cli.node("node5"), lambda node: "DOWN" in node.state, timeout_s=45)
    assert "DOWN" in node.state and node.reason == "Not responding"
    assert sinfo_reasons(slurm_cluster)["node5"] == "Not responding"


async def test_a_stopped_controller_is_a_dependency_failure(slurm_cluster: SlurmCluster) -> None:
    cli = SlurmCli(conf=slurm_cluster.conf_path, timeout_s=8)
    slurm_cluster.stop_controller()

    assert not await cli.reachable()
    for call in (cli.nodes, lambda: cli.requeue(1)):  # a read, and the write that misnames the failure
        started = time.monotonic()
        with pytest.raises(SlurmUnavailableError, match="controller"):
            await call()
        assert time.monotonic() - started < cli.timeout_s + 2  # bounded by the timeout: never a hang


async def test_a_frozen_controller_times_out_instead_of_hanging(slurm_cluster: SlurmCluster) -> None:
    cli = SlurmCli(conf=slurm_cluster.conf_path, timeout_s=2)
    slurm_cluster.pause_controller()  # it accepts connections and answers nothing

    started = time.monotonic()
    with pytest.raises(SlurmUnavailableError, match=r"did not answer `sinfo --json` within 2 s"):
        await cli.nodes()
    assert time.monotonic() - started < cli.timeout_s + 3


async def test_missing_slurm_commands_are_a_dependency_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a host without Slurm's client commands
    with pytest.raises(SlurmUnavailableError, match="sinfo not found"):
        await SlurmCli(conf=tmp_path / "slurm.conf").nodes()


@pytest.mark.parametrize(
    ("call", "refused"),
    [
        (lambda cli: cli.drain("node1 State=RESUME", reason="x"), "not a Slurm name"),
        (lambda cli: cli.drain("node[1-3]", reason="x"), "not a Slurm name"),
        (lambda cli: cli.drain("-h", reason="x"), "not a Slurm name"),
        (lambda cli: cli.drain("node1", reason="line one\nline two"), "one line"),
        (lambda cli: cli.drain("node1", reason=" "), "non-empty"),
        (lambda cli: cli.drain("node1", reason="x" * 256), "at most 255"),
        (lambda cli: cli.resume("node1,node2"), "not a Slurm name"),
        (lambda cli: cli.requeue(0), "not a Slurm job id"),
        (lambda cli: cli.requeue(7, exclude=["node1 x"]), "not a Slurm name"),
    ],
)
async def test_arguments_that_could_smuggle_an_option_are_refused_before_any_command(
    call: Callable[[SlurmCli], Awaitable[None]], refused: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # had a command run, this would say "not found"
    with pytest.raises(SlurmError, match=refused) as raised:
        await call(SlurmCli(conf=tmp_path / "slurm.conf"))
    assert not isinstance(raised.value, SlurmUnavailableError)


@pytest.mark.parametrize(
    "fields",
    [
        {"extra_args": ("-w", "node1")},  # a positional would be read as the script's path
        {"extra_args": ("--nodelist node1",)},
        {"extra_args": ("--wrap=rm -rf /",)},
        {"extra_args": ("--nodes=99",)},
        {"exclude": ("node1,node2",)},
        {"partition": "--partition=x"},
        {"name": "two\nlines"},
        {"script": "srun hostname"},
    ],
)
def test_a_submission_takes_only_validated_options(fields: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SlurmSubmission.model_validate({"name": "job", "nodes": 2, "script": "#!/bin/sh\n", **fields})


def test_a_submission_passes_the_job_specs_options() -> None:
    submission = SlurmSubmission(
        name="train",
        nodes=5,
        script="#!/bin/sh\n",
        partition="gpu",
        account="ml-team",
        time_limit_min=90,
        exclude=("node3",),
        extra_args=("--gres=gpu:8", "--exclusive"),
    )
    assert submission.argv() == [
        "--parsable",
        "--job-name=train",
        "--nodes=5",
        "--ntasks-per-node=1",
        "--requeue",
        "--partition=gpu",
        "--account=ml-team",
        "--time=90",
        "--exclude=node3",
        "--gres=gpu:8",
        "--exclusive",
    ]


@pytest.mark.parametrize(
    ("expression", "names"),
    [
        ("", ()),
        ("node3", ("node3",)),
        ("node[1-3]", ("node1", "node2", "node3")),
        ("node[1-2,5],gpu07", ("node1", "node2", "node5", "gpu07")),
        ("gpu[08-10]-ib", ("gpu08-ib", "gpu09-ib", "gpu10-ib")),
    ],
)
def test_slurm_node_lists_expand_to_names(expression: str, names: tuple[str, ...]) -> None:
    assert expand_hostlist(expression) == names
