"""A job's placement is one NATS message: 4,096 nodes x 8 ranks fit the configured max_payload; a job whose placement
could not be published is refused at submit (409) and leaves nothing behind."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reprise_cli.client import poll
from reprise_cli.servers import NatsServer, deploy_dir, free_port
from reprise_common.bus import Bus
from reprise_common.errors import ConflictError
from reprise_common.events import GpuStatus, NodeReport, RankAssignment
from reprise_orchestrator.jobs.launch import PLACEMENT_HEADROOM_BYTES, check_placement_fits, placement_event
from reprise_orchestrator.jobs.models import JobCreate

_UNITS = {"": 1, "KB": 1024, "MB": 1024**2}


def _configured_max_payload(config: Path) -> int:
    match = re.search(r"^max_payload:\s*(\d+)\s*(KB|MB|)\s*$", config.read_text(), re.MULTILINE)
    assert match is not None, f"no max_payload in {config}"
    return int(match.group(1)) * _UNITS[match.group(2)]


def _ranks(nodes: int, per_node: int) -> list[RankAssignment]:
    """Ranks on nodes with ids of the longest length allowed (64 characters)."""
    return [
        RankAssignment(rank=n * per_node + local, node_id=f"{n:064d}", gpu=local, local_rank=local)
        for n in range(nodes)
        for local in range(per_node)
    ]


async def test_4096_nodes_of_8_ranks_fit_and_four_times_as_many_ranks_are_refused(nats_server: NatsServer) -> None:
    spec = JobCreate(name="big", node_count=4096, ranks_per_node=8, command=["train"])
    ranks = _ranks(4096, 8)
    size = len(placement_event("job-0123456789ab", spec, ranks, restart_epoch=999).to_bytes())
    limit = _configured_max_payload(deploy_dir() / "nats" / "nats.conf")
    assert size + PLACEMENT_HEADROOM_BYTES <= limit
    assert size > 1024 * 1024  # the old 1 MB limit could not carry it

    bus = Bus(url=nats_server.url, service="test", provision=False)
    await bus.connect(attempts=5)
    assert bus.max_payload == limit  # the server runs the configuration the project writes
    check_placement_fits(bus, spec, ranks)
    with pytest.raises(ConflictError, match="max_payload"):
        check_placement_fits(bus, spec.model_copy(update={"ranks_per_node": 32}), _ranks(4096, 32))
    await bus.close()


@pytest.fixture
def small_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """nats-server with the project's configuration, but a max_payload of 64 KB."""
    config = tmp_path / "nats.conf"
    text = (deploy_dir() / "nats" / "nats.conf").read_text()
    config.write_text(re.sub(r"^max_payload:.*$", "max_payload: 64KB", text, flags=re.MULTILINE))
    server = NatsServer(free_port(), free_port(), tmp_path / "nats-store", tmp_path / "nats.log", config=config)
    server.start()
    yield server
    server.stop()


def test_a_job_whose_placement_cannot_be_published_is_refused(small_nats: NatsServer, admin_client: Any) -> None:
    with admin_client(small_nats.url, command_timeout_s=1.0) as client:
        assert poll(lambda: client.get("/readyz").status_code, lambda status: status == 200, timeout_s=15) == 200
        for n in range(1200):
            node = f"node-{n:04d}"
            report = NodeReport(source=node, node_id=node, interval_s=1.0, gpu_backend="sim", gpus=[GpuStatus(index=0)])
            client.app.state.inventory.observe(node, report)  # type: ignore[attr-defined]  # as its report would

        refused = client.post("/v1/jobs", json={"name": "big", "node_count": 1200, "command": ["train"]})
        assert refused.status_code == 409, refused.text
        assert "max_payload" in refused.json()["detail"]
        assert client.get("/v1/jobs").json()["count"] == 0  # nothing pending holds the nodes

        accepted = client.post("/v1/jobs", json={"name": "fits", "node_count": 300, "command": ["train"]})
        assert accepted.status_code == 201, accepted.text
        assert accepted.json()["state"] == "failed"  # published, then launched on nodes where no agent answers
