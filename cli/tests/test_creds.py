"""Per-node NATS identity against a real nats-server: node A cannot publish as node B or read B's commands.

The services' identities: test_service_identities.py and test_service_jetstream.py."""

from __future__ import annotations

import asyncio
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import nats
import pytest

from reprise_cli.creds import Credentials, Identity, init_credentials
from reprise_cli.servers import NatsServer, deploy_dir
from reprise_common import subjects
from reprise_common.aio import poll_until
from reprise_common.bus import Bus, Delivery, Outcome
from reprise_common.errors import BusError
from reprise_common.events import Event, GpuXid, NodeReport


@pytest.fixture
def identities(tmp_path: Path) -> Credentials:
    return init_credentials(
        tmp_path / "creds", nodes=["node-a", "node-b"], base_config=deploy_dir() / "nats" / "nats.conf"
    )


@pytest.fixture
def secured_nats(identities: Credentials, start_secured_nats: Callable[[Credentials], NatsServer]) -> NatsServer:
    return start_secured_nats(identities)


@pytest.fixture
async def admin_bus(secured_nats: NatsServer, identities: Credentials) -> AsyncIterator[Bus]:
    bus = Bus(url=secured_nats.url, service="admin", nkey_seed_file=identities.admin.seed_file)
    await bus.connect(attempts=5)
    yield bus
    await bus.close()


def _agent_bus(server: NatsServer, ident: Identity, node: str) -> Bus:
    return Bus(
        url=server.url,
        service=f"agent-{node}",
        nkey_seed_file=ident.seed_file,
        inbox_prefix=subjects.inbox_prefix(node),
        provision=False,
    )


def test_seeds_are_private_and_config_holds_only_public_keys(identities: Credentials) -> None:
    everyone = [identities.admin, *identities.services.values(), *identities.agents.values()]
    assert len({ident.public_key for ident in everyone}) == len(everyone)  # no two processes share a key
    for ident in everyone:
        assert stat.S_IMODE(ident.seed_file.stat().st_mode) == 0o600
        assert ident.public_key.startswith("U")
    config = identities.server_config.read_text()
    for ident in everyone:
        assert ident.public_key in config
    for ident in everyone:  # no seed (private key) ever lands in the server config
        assert ident.seed_file.read_text().strip() not in config


async def test_node_a_cannot_publish_as_node_b(
    secured_nats: NatsServer, admin_bus: Bus, identities: Credentials
) -> None:
    reports: list[str] = []
    events: list[str] = []

    async def record_reports(batch: dict[str, bytes]) -> None:
        reports.extend(batch)

    async def record_event(event: Event, delivery: Delivery) -> Outcome:
        events.append(delivery.subject)
        return Outcome.ACK

    await admin_bus.follow(subjects.AGENT_REPORTS, handler=record_reports).open()
    admin_bus.consumer(
        stream="AGENT", durable="watch", filter_subject=subjects.AGENT_EVENTS, handler=record_event
    ).start()
    node_a = _agent_bus(secured_nats, identities.agents["node-a"], "node-a")
    await node_a.connect(attempts=5)
    report = NodeReport(source="node-a", node_id="node-b", interval_s=1.0, gpu_backend="sim")
    # Reports (core NATS): the server drops node B's subject and delivers node A's own, sent after it on the same
    # connection; had B's passed, it would have arrived first.
    await node_a.publish_snapshot(subjects.node_report("node-b"), report)
    await node_a.publish_snapshot(subjects.node_report("node-a"), report)
    assert await poll_until(lambda: reports, timeout_s=5)
    assert reports == [subjects.node_report("node-a")]
    # Events (JetStream): node B's subject is refused by the server (no JetStream ack comes back).
    xid = GpuXid(source="node-a", node_id="node-b", gpu=0, xid=79)
    with pytest.raises(BusError, match=r"publish to reprise\.agent\.node-b\.event\.gpu\.xid failed"):
        await node_a.publish(subjects.node_event("node-b", xid.type), xid, timeout=1.0)
    await node_a.publish(subjects.node_event("node-a", xid.type), xid.model_copy(update={"event_id": "a"}))
    assert await poll_until(lambda: events, timeout_s=5)
    assert events == [subjects.node_event("node-a", xid.type)]
    await node_a.close()


async def test_node_a_cannot_read_node_b_commands(secured_nats: NatsServer, identities: Credentials) -> None:
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc = await nats.connect(
        secured_nats.url,
        nkeys_seed=str(identities.agents["node-a"].seed_file),
        inbox_prefix=subjects.inbox_prefix("node-a"),
        error_cb=on_error,
    )
    await nc.subscribe(subjects.node_command("node-b"))
    await nc.flush()
    await asyncio.sleep(0.3)
    assert any("permissions violation for subscription" in str(e).lower() for e in errors), errors
    await nc.close()


async def test_unknown_identity_is_refused(secured_nats: NatsServer) -> None:
    with pytest.raises(Exception):  # noqa: B017 - nats-py raises its own error types for an auth failure
        await nats.connect(secured_nats.url, allow_reconnect=False, connect_timeout=2)
