"""A second compute backend needs nothing but an implementation of the protocol and the setting that names it.

The orchestrator runs with `REPRISE_COMPUTE_BACKEND=backend_double:create` (tests/backend_double.py, a scheduler
that cannot run here, in memory) on the real nats-server, Redis and checkpoint registry: a job is placed on the
backend's nodes, a GPU fault on one of them is recovered through the backend (stop, cordon with the incident's
reason, a spare in its place, a launch of the new epoch), and the backend's own failure signal is announced on the
COMPUTE stream. Also: a setting naming no loadable backend stops the replica with a clear error.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from reprise_cli.client import poll
from reprise_cli.servers import NatsServer
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.errors import ConfigError
from reprise_common.events import (
    Category,
    ComputeSignal,
    ComputeSignalKind,
    Culprit,
    IncidentChange,
)
from reprise_orchestrator.app import create_app
from reprise_orchestrator.settings import OrchestratorSettings

from . import incidents
from .conftest import AdminClient
from .stack_harness import stored

HERE = Path(__file__).resolve().parent


@pytest.fixture
def double(monkeypatch: pytest.MonkeyPatch) -> object:
    """The double's module, importable by the name the setting gives, with its record of calls cleared."""
    monkeypatch.syspath_prepend(str(HERE))
    import backend_double

    backend_double.CALLS.__init__()  # type: ignore[misc]
    return backend_double


async def _publish(url: str, incident: IncidentChange) -> None:
    bus = Bus(url=url, service="test-backend")
    await bus.connect(attempts=10)
    try:
        await bus.publish(subjects.incident(incident.job_id, "opened"), incident)
    finally:
        await bus.close()


def test_a_job_is_placed_and_recovered_through_a_backend_named_by_a_setting(
    admin_client: AdminClient, nats_server: NatsServer, registry: str, double: object
) -> None:
    calls = double.CALLS  # type: ignore[attr-defined]
    settings = {"compute_backend": "backend_double:create", "registry_url": registry, "stop_grace_s": 1}
    with admin_client(nats_server.url, **settings) as client:
        body = {"name": "on-the-double", "node_count": 2, "command": ["train"], "policy": {"backoff_initial_s": 0}}
        job = client.post("/v1/jobs", json=body).raise_for_status().json()
        assert (job["state"], [r["node_id"] for r in job["placement"]]) == ("running", ["d-1", "d-2"])
        assert calls.launches == [(0, ["d-1", "d-2"])]

        xid = incidents.gpu_fault(node_id="d-2", rank=1, incident_id="inc-double", job_id=job["id"])
        asyncio.run(_publish(nats_server.url, xid))

        def recovered() -> list[dict[str, object]]:
            return list(client.get(f"/v1/jobs/{job['id']}/recoveries").json()["data"])

        found = poll(recovered, lambda r: bool(r) and r[0]["step"] in ("running", "failed", "held"), timeout_s=30)
        assert found and (found[0]["step"], found[0]["outcome"]) == ("running", "recovered"), found[:1]
        after = client.get(f"/v1/jobs/{job['id']}").json()
        nodes = {n["node_id"]: n for n in client.get("/v1/nodes").json()}

    assert [r["node_id"] for r in after["placement"]] == ["d-1", "d-spare"]  # the spare in the lost GPU's place
    assert calls.stops[0] == ["d-1", "d-2"]
    assert calls.cordons == [("d-2", f"incident inc-double: {xid.root_cause}")]  # told, naming the incident
    assert calls.launches[-1] == (1, ["d-1", "d-spare"])
    assert nodes["d-2"]["cordoned"] and nodes["d-2"]["cordon_reason"] == xid.root_cause
    signals = asyncio.run(stored(nats_server.url, subjects.compute_signal("double"), subjects.COMPUTE_STREAM))
    assert [(s.kind, s.node_id) for s in signals if isinstance(s, ComputeSignal)] == [
        (ComputeSignalKind.NODE_DOWN, "d-3")
    ]


def test_the_first_stop_of_a_hangs_recovery_asks_for_the_ranks_stacks_and_a_crashs_does_not(
    admin_client: AdminClient, nats_server: NatsServer, registry: str, double: object
) -> None:
    calls = double.CALLS  # type: ignore[attr-defined]
    settings = {"compute_backend": "backend_double:create", "registry_url": registry, "stop_grace_s": 1}
    with admin_client(nats_server.url, **settings) as client:
        body = {"name": "hangs", "node_count": 2, "command": ["train"], "policy": {"backoff_initial_s": 0}}
        job = client.post("/v1/jobs", json=body).raise_for_status().json()

        def recoveries() -> list[dict[str, object]]:
            return list(client.get(f"/v1/jobs/{job['id']}/recoveries").json()["data"])

        hang = incidents.incident(
            incident_id="inc-hang",
            job_id=job["id"],
            category=Category.HANG,
            root_cause="job hung in training: no step progress for 12.0 s (limit 10.0 s)",
            culprit=Culprit(node_id="d-2", rank=1),
        )
        asyncio.run(_publish(nats_server.url, hang))
        found = poll(recoveries, lambda r: bool(r) and r[0]["step"] == "running", timeout_s=30)
        stopping = next(s for s in found[0]["steps"] if s["step"] == "stopping_ranks")
        assert stopping["data"]["stacks_for"] == "inc-hang"

        crash = incidents.incident(incident_id="inc-crash", job_id=job["id"], culprit=Culprit(node_id="d-1", rank=0))
        asyncio.run(_publish(nats_server.url, crash))
        poll(recoveries, lambda r: len(r) == 2 and r[0]["step"] == "running", timeout_s=30)

        # A hang the policy does not let recover (no restart allowed): the ranks it stops for good leave stacks too.
        client.post(f"/v1/jobs/{job['id']}/cancel").raise_for_status()  # its nodes for the next job (a stop too)
        refused = {**body, "name": "hangs-once", "policy": {"max_restarts": 0}}
        held = client.post("/v1/jobs", json=refused).raise_for_status().json()
        held_hang = incidents.incident(
            incident_id="inc-held", job_id=held["id"], category=Category.HANG, culprit=Culprit(node_id="d-1", rank=0)
        )
        asyncio.run(_publish(nats_server.url, held_hang))

        def ended() -> list[dict[str, object]]:
            return list(client.get(f"/v1/jobs/{held['id']}/recoveries").json()["data"])

        poll(ended, lambda r: bool(r) and r[0]["step"] in ("failed", "held"), timeout_s=30)
        poll(lambda: len(calls.stacks_for), lambda n: n == 4, timeout_s=10)  # the stop follows the recorded end
    assert calls.stacks_for == ["inc-hang", None, None, "inc-held"]


def test_a_containerized_jobs_end_lets_the_spares_drop_its_standbys_and_a_plain_jobs_does_not(
    admin_client: AdminClient, nats_server: NatsServer, registry: str, double: object
) -> None:
    calls = double.CALLS  # type: ignore[attr-defined]
    settings = {"compute_backend": "backend_double:create", "registry_url": registry, "stop_grace_s": 1}
    with admin_client(nats_server.url, **settings) as client:
        plain = {"name": "plain", "node_count": 2, "command": ["train"], "policy": {"max_restarts": 0}}
        boxed = {**plain, "name": "boxed", "container": {"image": "reprise/train:local"}}
        cancelled = client.post("/v1/jobs", json=boxed).raise_for_status().json()
        client.post(f"/v1/jobs/{cancelled['id']}/cancel").raise_for_status()
        bare = client.post("/v1/jobs", json=plain).raise_for_status().json()
        client.post(f"/v1/jobs/{bare['id']}/cancel").raise_for_status()
        assert calls.dropped_standbys == [cancelled["id"]]

        failed = client.post("/v1/jobs", json=boxed).raise_for_status().json()  # no restart allowed: it fails
        crash = incidents.incident(incident_id="inc-end", job_id=failed["id"], culprit=Culprit(node_id="d-1", rank=0))
        asyncio.run(_publish(nats_server.url, crash))
        poll(lambda: client.get(f"/v1/jobs/{failed['id']}").json(), lambda j: j["state"] == "failed", timeout_s=30)
        poll(lambda: list(calls.dropped_standbys), lambda d: len(d) == 2, timeout_s=10)
    assert calls.dropped_standbys == [cancelled["id"], failed["id"]]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("slurmish", "use one of agents, slurm, kubernetes or package.module:factory"),
        ("no_such_module:create", "cannot be loaded"),
        ("reprise_common.auth:MIN_ADMIN_KEY_LENGTH", "is not callable"),
    ],
)
def test_a_backend_that_cannot_be_loaded_is_a_clear_configuration_error(name: str, message: str) -> None:
    settings = OrchestratorSettings(compute_backend=name, admin_api_key="k" * 16 + "0123456789abcdef")
    with pytest.raises(ConfigError, match=message):
        create_app(settings)
