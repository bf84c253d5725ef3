"""The demo's four faults with the ranks in containers (`make demo RUNTIME=docker`, smaller): 2 nodes + 1 spare, a
dockerd of the stack's own, the base image, the real DDP script in one container per rank.

The same code as `reprise demo --runtime docker`: a crash, an XID 79 (the spare takes the node's place), a hang and
the loss of a node (its agent and its containers killed, as a lost host's would be) are each recovered without help,
and the job ends with the fault-free reference's parameters, bit for bit.
"""

from __future__ import annotations

from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from reprise_cli.demo.models import demo_faults
from reprise_cli.demo.scenario import Scenario
from reprise_cli.demo.training import Training
from reprise_cli.dockerd import docker_unavailable_reason

from .demo_checks import assert_demo_faults_recovered, demo_config, demo_stack

pytest.importorskip("torch", reason="PyTorch is not installed: the DDP demo job cannot run")
docker = pytest.importorskip("docker", reason="the docker SDK is not installed")
pytestmark = [
    pytest.mark.stack,
    pytest.mark.chaos,
    pytest.mark.timeout(420),
    pytest.mark.skipif(docker_unavailable_reason() is not None, reason=str(docker_unavailable_reason())),
]


def _container_events(url: str, since: datetime, job_id: str) -> list[dict[str, Any]]:
    """The daemon's start and die events of the job's containers since `since`, up to now. The SDK sends `until` in
    whole seconds (truncated): an event of this very second would be left out, so it asks up to 2 s ahead and the
    daemon streams the events until then."""
    client = docker.DockerClient(base_url=url, timeout=30)
    try:
        events = client.events(
            since=since,
            until=datetime.now(UTC) + timedelta(seconds=2),
            decode=True,
            filters={"type": "container", "label": f"io.reprise.job={job_id}"},
        )
        return [e for e in events if e.get("status") in ("start", "die")]
    finally:
        client.close()


def test_the_demo_faults_are_recovered_with_the_ranks_in_containers(tmp_path: Path) -> None:
    config = demo_config(tmp_path / "state", runtime="docker")
    training = Training(steps=88, checkpoint_every=8, step_sleep=0.1)
    began = datetime.now(UTC)
    with demo_stack(config, training, tmp_path / "reference") as demo:
        assert demo.stack.docker is not None and demo.stack.container_image is not None
        with closing(demo.stack.client()) as client:
            scenario = Scenario(demo.stack, client, training, say=print, work_dir=config.jobs_dir)
            scenario.image = demo.stack.container_image
            run = scenario.run(demo_faults(config.nodes), reference=demo.reference)
        events = _container_events(demo.stack.docker.url, began, run.job["id"])

    assert_demo_faults_recovered(run)  # bit for bit, with every rank in a container
    # The ranks ran in containers: one started for each rank of the first launch and for the replacement of the
    # crashed, the XID's and the hung rank (the node loss shrinks the job: its survivor restarts in place); every
    # container of the lost node died (with its agent) and none of the job's is left running.
    starts = [e["Actor"]["Attributes"] for e in events if e["status"] == "start"]
    assert len(starts) >= 2 + 3, starts
    assert {s["io.reprise.node"] for s in starts} >= {"node-1", "node-2", "spare-1"}
    alive: dict[str, int] = {}
    for event in events:
        alive[event["id"]] = alive.get(event["id"], 0) + (1 if event["status"] == "start" else -1)
    assert not [cid for cid, count in alive.items() if count > 0], events
    lost = [e for e in events if e["Actor"]["Attributes"]["io.reprise.node"] == "spare-1"]
    assert lost and lost[-1]["status"] == "die" and lost[-1]["Actor"]["Attributes"]["exitCode"] == "137", lost
