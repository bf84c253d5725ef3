"""A real nats-server that admits only the identities `reprise creds` writes, and each process's identity as the local
stack hands it out (topology.build_services): the tests of identities check the wiring, not a copy of it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from reprise_cli.creds import ADMIN, init_credentials, seed_file
from reprise_cli.servers import NatsServer, deploy_dir
from reprise_cli.topology import StackConfig, build_services, node_ids
from reprise_common import subjects
from reprise_common.bus import Bus

SERVICES = ("checkpoint-registry", "detector", "orchestrator", "notifier", "dashboard")
NODES = ("node-1", "node-2")


@dataclass(frozen=True)
class Deployment:
    """A secured nats-server and the seed file the stack gives each service (by name) and agent (by node id)."""

    server: NatsServer
    seeds: dict[str, Path]
    admin_seed: Path  # operator tools and tests: every subject

    @property
    def url(self) -> str:
        """The server's client URL."""
        return self.server.url

    def bus(self, name: str) -> Bus:
        """The bus a service or an agent opens with its own identity (an agent: its own inbox, no provisioning)."""
        if name in NODES:
            return Bus(
                url=self.url,
                service=f"agent-{name}",
                nkey_seed_file=self.seeds[name],
                inbox_prefix=subjects.inbox_prefix(name),
                provision=False,
            )
        return Bus(
            url=self.url,
            service=name,
            nkey_seed_file=self.seeds[name],
            inbox_prefix=subjects.inbox_prefix(name),
            updates_streams=name == subjects.STREAMS_OWNER,  # as Bus.for_service gives it
        )

    async def client(self, name: str, errors: list[Exception]) -> Client:
        """A plain client with the identity of a service or an agent; the server's refusals land in errors."""

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        return await nats.connect(
            self.url,
            nkeys_seed=str(self.seeds[name]),
            inbox_prefix=subjects.inbox_prefix(name),
            error_cb=on_error,
            allow_reconnect=False,
        )


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    """The identities of a two-node stack and a nats-server started with the configuration that admits them."""
    config = StackConfig(nodes=2, spares=0, state_dir=tmp_path / "state")
    init_credentials(
        config.creds_dir,
        nodes=[node for node, _spare in node_ids(config)],
        base_config=deploy_dir() / "nats" / "nats.conf",
    )
    seeds = {
        spec.env["REPRISE_NODE_ID"] if spec.role == "agent" else spec.name: Path(
            spec.env["REPRISE_NATS_NKEY_SEED_FILE"]
        )
        for spec in build_services(config)
    }
    assert set(seeds) == {*SERVICES, *NODES}
    server = NatsServer.start_on_free_ports(tmp_path, config=config.creds_dir / "nats.conf")
    yield Deployment(server=server, seeds=seeds, admin_seed=seed_file(config.creds_dir, ADMIN))
    server.stop()


@pytest.fixture
async def admin(deployment: Deployment) -> AsyncIterator[Client]:
    """A client with the admin identity, to watch what arrives and inspect streams."""
    client = await nats.connect(deployment.url, nkeys_seed=str(deployment.admin_seed))
    yield client
    await client.close()
