"""A plain torchrun-style script with no Reprise import (examples/plain_ddp.py) on the real platform: one rank is
SIGKILLed mid-run; Reprise relaunches the job, the script resumes from its own snapshot, the recovery is verified
without any step report, and the job ends `completed` with the parameters of a fault-free run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from reprise_cli.client import poll
from reprise_cli.stack import Stack
from reprise_common.events import FaultKind, InjectFault

pytestmark = [pytest.mark.stack, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "plain_ddp.py"
WORLD = 2  # 2 nodes x 1 rank
ENV = {"OMP_NUM_THREADS": "1"}  # as torchrun sets it: the ranks share the CPU


def argv(work: Path, *, step_sleep: float) -> list[str]:
    """The script's command line: 6 epochs of 16 steps per rank, a snapshot every 2 epochs."""
    return [sys.executable, str(SCRIPT), "--epochs", "6", "--save-every", "2", "--dataset-size", "1024",
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


def test_a_plain_script_survives_a_rank_crash_and_completes_with_fault_free_parameters(
    stack: Stack, tmp_path: Path
) -> None:
    work = tmp_path / "job"
    work.mkdir()
    reference = start_fault_free(tmp_path / "reference")
    client = stack.client()
    try:
        poll(client.nodes, lambda n: len(n) == 3, timeout_s=15)
        job = client.submit(
            {"name": "plain-ddp", "node_count": WORLD, "ranks_per_node": 1, "command": argv(work, step_sleep=0.05),
             "env": ENV, "policy": {"backoff_initial_s": 0}}
        )  # fmt: skip
        poll((work / "snapshot.pt").exists, bool, timeout_s=90)  # the script saved its own snapshot
        killed_at = time.monotonic()
        victim = next(r for r in client.job(job["id"])["placement"] if r["rank"] == 1)
        reply = client.inject(
            InjectFault(kind=FaultKind.RANK_KILL, rank=1, job_id=job["id"]), node_id=victim["node_id"]
        )
        assert reply.accepted, reply.detail

        done = poll(lambda: client.job(job["id"]), lambda j: j["state"] in ("completed", "failed"), timeout_s=180)
        ended_s = time.monotonic() - killed_at
        recoveries: list[dict[str, Any]] = client.recoveries(job["id"])
    finally:
        client.close()
        codes = [rank.wait(timeout=120) for rank in reference]

    assert done["state"] == "completed", (done, recoveries)
    [recovery] = recoveries  # one recovery, one attempt: finishing training failed nothing
    assert (recovery["outcome"], recovery["attempt"]) == ("recovered", 1), recovery
    verified = [s["data"] for s in recovery["steps"] if s["step"] == "verifying"]
    assert len(verified) == 1 and verified[0]["path"] in ("alive_past_settle", "completed"), verified
    print(f"job completed {ended_s:.1f} s after the kill; verified by {verified[0]['path']}: {verified[0]}")
    relaunched = next(stack.config.state_dir.glob(f"**/ranks/{job['id']}/epoch-1-rank-0.log")).read_text()
    assert f"resuming from {work / 'snapshot.pt'} at epoch" in relaunched, relaunched[-2000:]  # its own snapshot

    assert codes == [0] * WORLD
    resumed = torch.load(work / "final.pt", weights_only=True)
    expected = torch.load(tmp_path / "reference" / "final.pt", weights_only=True)
    assert resumed.keys() == expected.keys() and all(torch.equal(resumed[k], expected[k]) for k in resumed)
