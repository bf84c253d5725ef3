"""A rank restarted in place reads the resume-file listing of its new epoch, which the agent writes after the rank's
container started: the container sees the job's directory of listings from its first epoch on."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from reprise_agent.launch.container_policy import ContainerPolicy
from reprise_agent.launch.containers import ContainerEngine
from reprise_common.events import ContainerSpec, LaunchArgs, RankAssignment

from .conftest import PYTHON, REPO, Engine, python_mounts

PYTHON_HOME = Path(os.path.realpath(sys.base_prefix))
WAIT_FOR_LISTING = """
import os, pathlib, time
listing = pathlib.Path(os.environ["LISTING"])
print("up", flush=True)
for _ in range(300):
    if listing.exists():
        print(listing.read_text(), flush=True)
        break
    time.sleep(0.1)
else:
    raise SystemExit(f"{listing} never appeared")
"""


async def test_a_later_epochs_resume_files_are_visible_to_a_rank_started_without_any(
    docker_engine: Engine, tmp_path: Path
) -> None:
    ranks_dir = tmp_path / "state" / "ranks"
    engine = ContainerEngine(
        base_url=docker_engine.url,
        policy=ContainerPolicy(mount_roots=(PYTHON_HOME, REPO, tmp_path)),
        inbox_dir=tmp_path / "inbox",
        job_files_dir=ranks_dir,
    )
    spec = LaunchArgs(
        restart_epoch=0, world_size=1, master_addr="127.0.0.1", master_port=29500, command=[PYTHON],
        ranks=[RankAssignment(rank=0, node_id="n1", local_rank=0)],
        container=ContainerSpec(image=docker_engine.image, mounts=python_mounts()),
    )  # fmt: skip
    listing = ranks_dir / "job-1" / "epoch-1-resume-files.json"
    env = {"REPRISE_JOB_ID": "job-1", "REPRISE_NODE_ID": "n1", "REPRISE_RESTART_EPOCH": "0", "RANK": "0"}
    env |= {"REPRISE_RESUME_FILES": "", "LISTING": str(listing)}  # epoch 0: nothing to resume from
    handle = await engine.for_job(spec).start([PYTHON, "-c", WAIT_FOR_LISTING], env=env, cwd=str(REPO), warm=False)
    try:
        assert await asyncio.wait_for(handle.output.readline(), 60) == b"up\n"
        listing.write_text('[{"name": "rank-00000.pt"}]')  # what the agent writes for the rank's next epoch
        assert await asyncio.wait_for(handle.wait(), 60) == 0
        assert b"rank-00000.pt" in await handle.output.read()
    finally:
        handle.kill()
        engine.close()
