"""Restart in place end to end: the real DDP example under reprise_sdk.run on the real platform, a rank crash then an
XID 79; the survivors keep their processes (and restore from their copy in memory), only the failed ranks are
replaced, and the result is bit-identical."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from reprise_cli.client import PlatformClient, poll
from reprise_cli.demo.training import Training
from reprise_cli.stack import Stack
from reprise_common.events import FaultKind, InjectFault

pytestmark = [pytest.mark.stack, pytest.mark.timeout(300)]

TRAINING = Training(steps=90, checkpoint_every=10, step_sleep=0.05)


def reference(tmp_path: Path) -> dict[str, torch.Tensor]:
    """The fault-free run, alone (world size 1: the example's result does not depend on it)."""
    output = tmp_path / "reference" / "final.pt"
    argv = TRAINING.argv(checkpoint_dir=tmp_path / "reference" / "ckpt", output=output, step_sleep=0)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REPRISE_", "RANK", "WORLD_SIZE", "MASTER_"))}
    subprocess.run(argv, env=env, check=True, capture_output=True, timeout=300)
    state: dict[str, torch.Tensor] = torch.load(output)
    return state


def pids(stack: Stack, client: PlatformClient, job_id: str) -> dict[int, int]:
    """Each rank's pid in the job's current epoch, from the agents' ledgers of their running ranks."""
    epoch = client.job(job_id)["restart_epoch"]
    found = {}
    for ledger in stack.config.state_dir.glob("**/ranks/live.json"):
        with contextlib.suppress(OSError, ValueError):
            for entry in json.loads(ledger.read_text()):
                if entry["job_id"] == job_id and entry["restart_epoch"] == epoch:
                    found[entry["rank"]] = entry["pid"]
    return found


def recovered(client: PlatformClient, job_id: str, count: int) -> list[dict[str, Any]]:
    done = poll(
        lambda: client.recoveries(job_id),
        lambda r: len(r) >= count and all(x["outcome"] for x in r),
        timeout_s=120,
    )
    assert all(r["outcome"] == "recovered" for r in done), done
    return done


def test_survivors_restart_in_place_after_a_crash_and_an_xid_and_the_result_is_bit_identical(
    stack: Stack, tmp_path: Path
) -> None:
    work = tmp_path / "job"
    command = [*TRAINING.argv(checkpoint_dir=work / "ckpt", output=work / "final.pt"), "--in-place"]
    client = stack.client()
    try:
        poll(client.nodes, lambda n: len(n) == 3, timeout_s=15)
        job = client.submit(
            {"name": "in-place", "node_count": 2, "ranks_per_node": 2, "command": command,
             "env": {"REPRISE_SDK_KEEP_BYTES": str(1 << 20)}, "policy": {"backoff_initial_s": 0}}
        )  # fmt: skip
        poll(lambda: client.latest_checkpoint(job["id"]).status_code, lambda code: code == 200, timeout_s=120)
        before = poll(lambda: pids(stack, client, job["id"]), lambda p: len(p) == 4, timeout_s=60)

        # A rank crash: rank 3 is replaced, ranks 0-2 keep their processes.
        placement = {r["rank"]: r for r in client.job(job["id"])["placement"]}
        client.inject(InjectFault(kind=FaultKind.RANK_KILL, rank=3, job_id=job["id"]), node_id=placement[3]["node_id"])
        [crash] = recovered(client, job["id"], 1)
        steps = {s["step"]: s["data"] for s in crash["steps"]}
        assert steps["stopping_ranks"]["restart_mode"] == "in_place", steps["stopping_ranks"]
        assert steps["stopping_ranks"]["parked"] == 3 and steps["launching"]["in_place"] == 3
        after = poll(lambda: pids(stack, client, job["id"]), lambda p: len(p) == 4, timeout_s=60)
        assert [after[r] for r in (0, 1, 2)] == [before[r] for r in (0, 1, 2)] and after[3] != before[3]
        # Rank 0 kept its process: the ranks went on from the survivors' state (rank 0 sent it), not the checkpoint.
        epoch = client.job(job["id"])["restart_epoch"]
        rank0 = next(stack.config.state_dir.glob(f"**/ranks/{job['id']}/epoch-{epoch}-rank-0.log")).read_text()
        assert "from rank 0's memory (0 steps redone)" in rank0, rank0[-2000:]
        resumed = steps["verifying"]["resumed"]  # what the ranks told their agents, in the recovery's record
        assert resumed["via"] == "peer" and resumed["step"] > steps["restoring"]["checkpoint"]["step"], resumed

        # An XID 79 on rank 1's GPU: its node is cordoned, the spare takes its ranks; the other node's stay.
        step = client.latest_checkpoint(job["id"]).json()["step"]
        poll(lambda: client.latest_checkpoint(job["id"]).json()["step"], lambda s: s > step, timeout_s=120)
        placement = {r["rank"]: r for r in client.job(job["id"])["placement"]}
        hit = placement[1]
        client.inject(InjectFault(kind=FaultKind.XID, gpu=hit["gpu"], xid=79), node_id=hit["node_id"])
        xid = recovered(client, job["id"], 2)[0]
        steps = {s["step"]: s["data"] for s in xid["steps"]}
        assert steps["stopping_ranks"]["restart_mode"] == "in_place", steps["stopping_ranks"]
        assert steps["isolating"]["cordoned"] == hit["node_id"]
        stayed = [r for r, a in placement.items() if a["node_id"] != hit["node_id"]]
        assert steps["stopping_ranks"]["parked"] == len(stayed) == 2

        done = poll(lambda: client.job(job["id"]), lambda j: j["state"] in ("completed", "failed"), timeout_s=240)
        assert done["state"] == "completed", done
    finally:
        client.close()

    resumed: dict[str, torch.Tensor] = torch.load(work / "final.pt")
    fault_free = reference(tmp_path)
    assert resumed.keys() == fault_free.keys() and all(torch.equal(resumed[k], fault_free[k]) for k in resumed)
