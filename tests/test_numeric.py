"""A NaN in training: the real DDP example on the real platform rolls back before the fault and skips its data."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from reprise_cli.client import poll
from reprise_cli.demo.training import Training
from reprise_cli.stack import Stack

pytestmark = pytest.mark.stack

BAD_STEP = 25
TRAINING = Training(steps=40, checkpoint_every=10, step_sleep=0.05)


def reference(tmp_path: Path, *, skip: str) -> dict[str, torch.Tensor]:
    """The fault-free run, alone (world size 1: the example's result does not depend on it), skipping `skip`."""
    output = tmp_path / "reference" / "final.pt"
    argv = TRAINING.argv(checkpoint_dir=tmp_path / "reference" / "ckpt", output=output, step_sleep=0)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REPRISE_", "RANK", "WORLD_SIZE", "MASTER_"))}
    subprocess.run(argv, env={**env, "REPRISE_SKIP_STEPS": skip}, check=True, capture_output=True, timeout=300)
    state: dict[str, torch.Tensor] = torch.load(output)
    return state


def test_a_nan_at_step_k_rolls_back_before_k_skips_its_data_and_ends_equal_to_a_run_without_it(
    stack: Stack, tmp_path: Path
) -> None:
    work = tmp_path / "job"
    command = [*TRAINING.argv(checkpoint_dir=work / "ckpt", output=work / "final.pt"), "--bad-data-step", str(BAD_STEP)]
    client = stack.client()
    try:
        poll(client.nodes, lambda n: len(n) == 3, timeout_s=15)
        job = client.submit(
            {
                "name": "nan",
                "node_count": 2,
                "ranks_per_node": 1,
                "command": command,
                "policy": {"numeric": {"metrics": ["loss"], "skip_steps": 1}, "backoff_initial_s": 0},
            }
        )
        done = poll(lambda: client.job(job["id"]), lambda j: j["state"] in ("completed", "failed"), timeout_s=240)
        assert done["state"] == "completed", done

        [incident] = client.incidents(job["id"])
        assert incident["category"] == "numeric"
        assert incident["culprit_fault_step"] == BAD_STEP
        assert f"loss became NaN at step {BAD_STEP}" in incident["root_cause"]
        [recovery] = client.recoveries(job["id"])
        assert recovery["outcome"] == "recovered", recovery
        steps = {s["step"]: s["data"] for s in recovery["steps"]}
        restored = steps["restoring"]
        assert restored["before_step"] == BAD_STEP
        assert restored["checkpoint"]["step"] < BAD_STEP  # the newest validated checkpoint older than the fault
        assert "rolled back" in restored["note"]
    finally:
        client.close()

    resumed: dict[str, torch.Tensor] = torch.load(work / "final.pt")
    skipped = reference(tmp_path, skip=f"{BAD_STEP}-{BAD_STEP}")
    assert all(torch.isfinite(t).all() for t in resumed.values())
    assert resumed.keys() == skipped.keys() and all(torch.equal(resumed[k], skipped[k]) for k in resumed)
