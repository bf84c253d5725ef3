"""The Lightning and Hugging Face Trainer examples, each with its one-line callback, as jobs on the real platform:
a rank is killed, Reprise restores a checkpoint the callback reported (validated by the registry), the surviving rank
restarts in place, and both resume from it through the framework's own ``ckpt_path`` / ``resume_from_checkpoint``
and complete."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from reprise_cli.client import PlatformClient, poll
from reprise_cli.stack import Stack
from reprise_common.events import FaultKind, InjectFault

pytestmark = [pytest.mark.stack, pytest.mark.timeout(480)]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STEPS, EVERY = 40, 5


def command(framework: str, work: Path) -> list[str]:
    """The example's command line: 40 steps of at least 0.2 s, a checkpoint every 5, a validation every 10."""
    common = ["--steps", str(STEPS), "--step-sleep", "0.2", "--eval-every", "10", "--in-place"]
    if framework == "lightning":
        script, saving = "lightning_train.py", ["--checkpoint-every", str(EVERY), "--checkpoint-dir", str(work)]
    else:
        script, saving = "hf_train.py", ["--save-every", str(EVERY), "--output-dir", str(work)]
    return [sys.executable, str(EXAMPLES / script), *common, *saving]


def rank_log(stack: Stack, job_id: str, epoch: int, rank: int) -> str:
    return next(stack.config.state_dir.glob(f"**/ranks/{job_id}/epoch-{epoch}-rank-{rank}.log")).read_text()


@pytest.mark.parametrize("framework", ["lightning", "transformers"])
def test_a_framework_job_survives_a_rank_crash_and_resumes_from_the_restore_point(
    framework: str, stack: Stack, tmp_path: Path
) -> None:
    if importlib.util.find_spec("lightning" if framework == "lightning" else "transformers") is None:
        pytest.skip(f"{framework} is not installed")
    client = stack.client()
    try:
        poll(client.nodes, lambda n: len(n) == 3, timeout_s=15)
        job = client.submit(
            {"name": f"{framework}-job", "node_count": 1, "ranks_per_node": 2, "command": command(framework, tmp_path),
             "env": {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, "policy": {"backoff_initial_s": 0}}
        )  # fmt: skip
        first = poll(
            lambda: client.latest_checkpoint(job["id"]), lambda r: r.status_code == 200, timeout_s=180
        ).json()  # a checkpoint the callback reported, committed and validated by the registry
        assert first["world_size"] == 2 and first["state"] == "validated", first
        manifest = client.http.get(f"{client.registry}/v1/checkpoints/{first['id']}/files").json()["data"]
        assert {(f["rank"], f["algorithm"]) for f in manifest} == {(0, "sha256")}  # rank 0 reports every file
        names = {Path(f["path"]).name for f in manifest}
        wrote = (
            {"model.ckpt"} if framework == "lightning" else {"model.safetensors", "rng_state_0.pth", "rng_state_1.pth"}
        )
        assert wrote <= names, names  # the Trainer's rank 1 wrote its RNG state; rank 0 reported it too

        placement = {r["rank"]: r for r in client.job(job["id"])["placement"]}
        client.inject(InjectFault(kind=FaultKind.RANK_KILL, rank=1, job_id=job["id"]), node_id=placement[1]["node_id"])
        recovery = recovered(client, job["id"])
        steps = {s["step"]: s["data"] for s in recovery["steps"]}
        assert steps["stopping_ranks"]["restart_mode"] == "in_place", steps["stopping_ranks"]
        assert steps["stopping_ranks"]["parked"] == 1 and steps["launching"]["in_place"] == 1  # rank 0 kept its process
        restored = steps["restoring"]["checkpoint"]
        assert restored["step"] >= first["step"] and Path(restored["path"]).parent == tmp_path, restored

        done = poll(lambda: client.job(job["id"]), lambda j: j["state"] in ("completed", "failed"), timeout_s=180)
        assert done["state"] == "completed", done
    finally:
        client.close()

    expected = restored["path"] + ("/model.ckpt" if framework == "lightning" else "")
    for rank in (0, 1):  # rank 0 in its old process, rank 1 in a new one: both handed the path to the framework
        relaunched = rank_log(stack, job["id"], done["restart_epoch"], rank)
        assert f"resuming from {expected}\n" in relaunched, relaunched[-3000:]
    assert f"trained to step {STEPS}\n" in rank_log(stack, job["id"], done["restart_epoch"], 0)


def recovered(client: PlatformClient, job_id: str) -> dict[str, Any]:
    """The job's one recovery, once it has an outcome (which must be recovered): a replacement rank imports its
    framework cold, which takes minutes on a loaded 2-core machine."""
    [done] = poll(lambda: client.recoveries(job_id), lambda r: len(r) == 1 and bool(r[0]["outcome"]), timeout_s=240)
    assert done["outcome"] == "recovered", {s["step"]: s["data"] for s in done["steps"]}
    return done
