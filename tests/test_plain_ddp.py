"""A plain torchrun-style script with no Reprise import (examples/plain_ddp.py) through the demo's four faults on the
real platform: a rank SIGKILLed, its GPU's XID 79, the rank SIGSTOPped, its node lost. Two spares keep the world size.
After each fault Reprise relaunches the job, the script resumes from its own snapshot, the recovery is verified
without any step report, and the job ends `completed` with the parameters of a fault-free run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from reprise_cli.client import PlatformClient, poll
from reprise_cli.demo.models import Fault, demo_faults, fault_event
from reprise_cli.stack import Stack
from reprise_cli.topology import StackConfig
from reprise_common.clock import utcnow

pytestmark = [pytest.mark.stack, pytest.mark.timeout(420)]

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "plain_ddp.py"
WORLD = 2  # 2 nodes x 1 rank
ENV = {"OMP_NUM_THREADS": "1"}  # as torchrun sets it: the ranks share the CPU
HANG_S = 4.0  # the job's hang limit: a stopped rank is timed as training


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """`reprise up` with two one-GPU workers and two spares: the XID's node is cordoned, the lost node stays lost."""
    running = Stack(StackConfig(nodes=2, spares=2, gpus_per_node=1, state_dir=tmp_path / "state"), free_ports=True)
    try:
        running.start(timeout_s=90)
        yield running
    finally:
        running.stop()


def argv(work: Path, *, step_sleep: float) -> list[str]:
    """The script's command line: 40 epochs of 16 steps per rank, a snapshot after every epoch."""
    return [sys.executable, str(SCRIPT), "--epochs", "40", "--save-every", "1", "--dataset-size", "1024",
            "--step-sleep", f"{step_sleep:g}",
            "--snapshot-path", str(work / "snapshot.pt"), "--output", str(work / "final.pt")]  # fmt: skip


def start_fault_free(work: Path) -> list[subprocess.Popen[bytes]]:
    """The same training as 2 plain local processes, never interrupted (started now, read at the end)."""
    work.mkdir(parents=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPRISE_")} | ENV
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD)}
    return [
        subprocess.Popen(
            argv(work, step_sleep=0), env=env | {"RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.DEVNULL
        )
        for r in range(WORLD)
    ]


def wait_for_a_new_snapshot(snapshot: Path, *, after: float, timeout_s: float = 90) -> None:
    """Until the script saved a snapshot later than `after` (a wall-clock time): the next fault has something new to
    resume from."""
    poll(lambda: snapshot.exists() and snapshot.stat().st_mtime > after, bool, timeout_s=timeout_s)


def recovery_of(client: PlatformClient, job_id: str, since: datetime, known: set[str]) -> dict[str, Any] | None:
    """The first recovery of the job started at or after `since` that no earlier fault accounts for, once it ended."""
    fresh = [r for r in client.recoveries(job_id)
             if r["id"] not in known and datetime.fromisoformat(r["started_at"]) >= since]  # fmt: skip
    first = min(fresh, key=lambda r: r["started_at"], default=None)
    return first if first is not None and first["step"] in ("running", "failed", "held") else None


def test_a_plain_script_survives_the_demos_four_faults_and_completes_with_fault_free_parameters(
    stack: Stack, tmp_path: Path
) -> None:
    work = tmp_path / "job"
    work.mkdir()
    snapshot = work / "snapshot.pt"
    reference = start_fault_free(tmp_path / "reference")
    client = stack.client()
    recovered: list[dict[str, Any]] = []
    try:
        poll(client.nodes, lambda n: len(n) == 4, timeout_s=15)
        job = client.submit(
            {"name": "plain-ddp", "node_count": WORLD, "ranks_per_node": 1, "command": argv(work, step_sleep=0.05),
             "env": ENV, "policy": {"backoff_initial_s": 0, "hang_timeout_s": HANG_S}}
        )  # fmt: skip
        wait_for_a_new_snapshot(snapshot, after=0)
        for plan in demo_faults(WORLD):
            placed = client.job(job["id"])
            assert placed["state"] == "running", placed
            victim = next(r for r in placed["placement"] if r["rank"] == plan.rank)
            if plan.fault is Fault.NODE_LOSS:
                stack.lose_node(victim["node_id"])
            injected_at = utcnow()
            event = fault_event(plan, job_id=job["id"], gpu=victim.get("gpu"))
            reply = client.inject(event, node_id=victim["node_id"])
            assert reply.accepted, (plan, reply.detail)
            known = {r["id"] for r in recovered}
            recovery = poll(
                lambda at=injected_at, seen=known: recovery_of(client, job["id"], at, seen), bool, timeout_s=90
            )
            recovered.append(recovery)
            took = (datetime.fromisoformat(recovery["finished_at"]) - injected_at).total_seconds()
            print(f"{plan.fault}: {recovery['outcome']} {took:.1f} s after it, in attempt {recovery['attempt']}")
            assert (recovery["outcome"], recovery["attempt"]) == ("recovered", 1), (plan, recovery)
            wait_for_a_new_snapshot(snapshot, after=time.time())
        done = poll(lambda: client.job(job["id"]), lambda j: j["state"] in ("completed", "failed"), timeout_s=180)
        recoveries = client.recoveries(job["id"])
        incidents = client.incidents(job["id"])
    finally:
        client.close()
        codes = [rank.wait(timeout=180) for rank in reference]

    assert done["state"] == "completed", (done, recoveries)
    assert len(recoveries) == len(recovered) == 4, recoveries  # one recovery per fault, nothing else
    assert len(done["placement"]) == WORLD, done["placement"]  # the spares kept the world size
    causes = {i["id"]: (i["category"], i["root_cause"]) for i in incidents}
    by_fault = [causes.get(r["incident_id"], ("?", "?")) for r in recovered]
    assert [category for category, _ in by_fault][2] == "hang", by_fault  # the SIGSTOPped rank, without the SDK
    for recovery in recovered:
        [verified] = [s["data"] for s in recovery["steps"] if s["step"] == "verifying"]
        assert verified["path"] in ("alive_past_settle", "completed"), verified
    assert len({r["node_id"] for r in done["placement"]}) == WORLD, done["placement"]  # one rank per node
    relaunched = sorted(stack.config.state_dir.glob(f"**/ranks/{job['id']}/epoch-*-rank-0.log"))
    assert any(f"resuming from {snapshot} at epoch" in log.read_text() for log in relaunched), relaunched

    assert codes == [0] * WORLD
    resumed = torch.load(work / "final.pt", weights_only=True)
    expected = torch.load(tmp_path / "reference" / "final.pt", weights_only=True)
    assert resumed.keys() == expected.keys() and all(torch.equal(resumed[k], expected[k]) for k in resumed)
