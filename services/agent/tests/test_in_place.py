"""Restart in place on a real agent: real ranks in a real gloo group under reprise_sdk.run, a peer killed or frozen."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from reprise_cli.servers import NatsServer, free_port
from reprise_common.events import CommandAction, CommandResult, NodeReport, RankExited, RankParked
from reprise_common.procs import ProcessSample, process_alive, sample_process

from .test_agent import Harness, running_agent, wait_for

pytest.importorskip("torch", reason="PyTorch is not installed: restart in place is tested with a real gloo group")

TRAIN = """
import os, time
from datetime import timedelta
import torch, torch.distributed as dist
import reprise_sdk

def train(info):
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    print(f"enter epoch={info.restart_epoch} rank={info.rank} world={info.world_size} pid={os.getpid()}", flush=True)
    total, step = torch.ones(1), 0
    while True:
        dist.all_reduce(total)
        step += 1
        reprise_sdk.heartbeat(step)
        time.sleep(0.02)

reprise_sdk.run(train)
"""


@pytest.fixture
async def harness(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Harness]:
    async with running_agent(nats_server, tmp_path, report_interval_s=0.1) as h:
        yield h


def command(tmp_path: Path) -> list[str]:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    return [sys.executable, str(script)]


async def launch(harness: Harness, argv: list[str], *, epoch: int, gpus: tuple[int, ...], fence: int = 1) -> list[int]:
    reply = await harness.command(
        CommandAction.LAUNCH,
        fence=fence,
        command_id=f"l{epoch}",
        restart_epoch=epoch,
        world_size=len(gpus),
        master_addr="127.0.0.1",
        master_port=free_port(),
        command=argv,
        ranks=[{"rank": i, "node_id": "n1", "gpu": gpu, "local_rank": i} for i, gpu in enumerate(gpus)],
    )
    assert reply.result is CommandResult.DONE, reply
    return [int(pid) for pid in reply.data["pids"]]


async def training(harness: Harness, tmp_path: Path) -> tuple[list[str], list[int]]:
    """Three ranks of the gloo script under reprise_sdk.run, stepping, each announced as able to restart in place."""
    argv = command(tmp_path)
    pids = await launch(harness, argv, epoch=0, gpus=(0, 1, 2))
    assert await wait_for(lambda: stepping(harness, 0, 3), timeout_s=60)
    assert await wait_for(lambda: all(r.in_place for r in harness.agent.supervisor.ranks()))
    return argv, pids


def entered(harness: Harness, epoch: int) -> list[str]:
    return [line for r in harness.agent.supervisor.ranks() for line in r.tail if f"enter epoch={epoch} " in line]


def stepping(harness: Harness, epoch: int, ranks: int) -> bool:
    reports = [e for e in harness.events if isinstance(e, NodeReport)]
    if not reports:
        return False
    mine = [r for r in reports[-1].ranks if r.restart_epoch == epoch and r.step]
    return len(mine) == ranks


async def test_survivors_of_a_killed_peer_park_and_take_the_next_epoch_in_their_own_processes(
    harness: Harness, tmp_path: Path
) -> None:
    argv, pids = await training(harness, tmp_path)

    os.kill(pids[2], signal.SIGKILL)  # its peers' next all_reduce fails: they park on their own
    assert await wait_for(lambda: sum(r.parked.is_set() for r in harness.agent.supervisor.ranks()) == 2)
    stop = await harness.command(
        CommandAction.STOP, fence=1, command_id="s", grace_s=2.0, park_within_s=5.0, kill_ranks=[2]
    )
    assert stop.result is CommandResult.DONE and stop.data["parked"] == [0, 1]
    assert process_alive(pids[0]) and process_alive(pids[1])

    relaunched = await launch(harness, argv, epoch=1, gpus=(0, 1, 2))
    assert relaunched[:2] == pids[:2] and relaunched[2] != pids[2]  # same processes for the survivors, a new one
    assert await wait_for(lambda: stepping(harness, 1, 3), timeout_s=60)
    assert sorted(entered(harness, 1)) == sorted(
        [f"enter epoch=1 rank={r} world=3 pid={pid}" for r, pid in enumerate(relaunched)]
    )
    exits = [e for e in harness.events if isinstance(e, RankExited)]
    assert [(e.rank, e.restart_epoch) for e in exits] == [(2, 0)]  # the parked ranks' restart is not an exit
    logs = tmp_path / "agent" / "ranks" / "job-1"
    assert f"enter epoch=1 rank=0 world=3 pid={pids[0]}" in (logs / "epoch-1-rank-0.log").read_text()  # its own file
    assert "enter epoch=1" not in (logs / "epoch-0-rank-0.log").read_text()


async def test_a_rank_parked_by_its_peer_s_death_is_published_once_with_what_it_caught(
    harness: Harness, tmp_path: Path
) -> None:
    _, pids = await training(harness, tmp_path)
    os.kill(pids[2], signal.SIGKILL)
    assert await wait_for(lambda: len(harness.of_type(RankParked)) == 2, timeout_s=30)

    # A rank saying it again (a repeated datagram) is not a new parking; a heartbeat after it shows it was read.
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sdk:
        for rank, body in ((0, {"k": "parked", "why": "again"}), (1, {"k": "parked", "why": "again"}),
                           (0, {"k": "hb", "step": 10**9})):  # fmt: skip
            sent = {"v": 1, "job": "job-1", "rank": rank, "epoch": 0, "t_ns": time.time_ns(), **body}
            sdk.sendto(json.dumps(sent).encode(), str(harness.agent.sdk.path))
    assert await wait_for(lambda: harness.agent.progress.status_fields("job-1", 0)["step"] == 10**9)
    await harness.agent.outbox.flush(timeout_s=5.0)  # on the stream now: wait until the test has read it all
    for _ in range(500):
        info = await harness.client.js.consumer_info("AGENT", "test")
        if info.num_pending == 0 and info.num_ack_pending == 0:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError(f"the test's consumer did not read every event: {info}")
    parked = [e for e in harness.events if isinstance(e, RankParked)]
    assert sorted((e.node_id, e.job_id, e.rank, e.restart_epoch) for e in parked) == [
        ("n1", "job-1", 0, 0),
        ("n1", "job-1", 1, 0),
    ]
    whys = {r.rank: r.parked_why for r in harness.agent.supervisor.ranks() if r.parked.is_set()}
    assert {e.rank: e.why for e in parked} == whys
    assert all(e.why.startswith("RuntimeError: ") and "again" not in e.why for e in parked)  # the failed all_reduce


async def test_a_frozen_rank_is_killed_its_peers_park_and_parked_ranks_without_a_place_are_stopped(
    harness: Harness, tmp_path: Path
) -> None:
    argv, pids = await training(harness, tmp_path)
    os.kill(pids[1], signal.SIGSTOP)  # a hang: the others wait in their all_reduce
    assert await wait_for(lambda: (sample_process(pids[1]) or ProcessSample("", 0)).state == "T")

    stop = await harness.command(
        CommandAction.STOP, fence=1, command_id="s", grace_s=1.0, park_within_s=5.0, kill_ranks=[1]
    )
    assert stop.result is CommandResult.DONE and stop.data["parked"] == [0, 2]
    assert not process_alive(pids[1])

    relaunched = await launch(harness, argv, epoch=1, gpus=(2,))  # the job shrank to one rank, on GPU 2
    assert relaunched == [pids[2]]
    assert await wait_for(lambda: not process_alive(pids[0]))  # parked, but the new epoch has no place for it
    assert await wait_for(lambda: stepping(harness, 1, 1), timeout_s=60)
    assert [e for e in harness.events if isinstance(e, RankExited)] == []  # every exit was the agent's doing
    # The peers parked because the recovery stopped the frozen rank: their errors are no evidence of a lost node.
    assert [e for e in harness.events if isinstance(e, RankParked)] == []


async def test_a_rank_that_does_not_park_within_the_bound_is_stopped_and_replaced_cold(
    harness: Harness, tmp_path: Path
) -> None:
    _, pids = await training(harness, tmp_path)
    os.kill(pids[1], signal.SIGSTOP)  # stuck, and not named a culprit: its peers wait in their collective for it
    assert await wait_for(lambda: (sample_process(pids[1]) or ProcessSample("", 0)).state == "T")
    stop = await harness.command(CommandAction.STOP, fence=1, command_id="s", grace_s=1.0, park_within_s=1.0)
    assert stop.result is CommandResult.DONE and stop.data["parked"] == []  # the bound passed: stopped as before
    assert not any(process_alive(pid) for pid in pids)


async def test_ranks_that_cannot_restart_in_place_are_stopped_as_before(harness: Harness) -> None:
    pids = await launch(harness, [sys.executable, "-c", "import time; time.sleep(600)"], epoch=0, gpus=(0, 1))
    stop = await harness.command(CommandAction.STOP, fence=1, command_id="s", grace_s=1.0, park_within_s=1.0)
    assert stop.result is CommandResult.DONE and stop.data["parked"] == []
    assert not any(process_alive(pid) for pid in pids)
