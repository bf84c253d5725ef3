"""Fixtures shared by every test in the monorepo: real nats-server, real Redis-compatible server, SQL databases.

No fakes for NATS, Redis or SQL: each fixture starts (or connects to) the real thing on a free port and stops it.
"""

from __future__ import annotations

import os
import secrets
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from reprise_cli.creds import Credentials
from reprise_cli.redis_server import RedisServer
from reprise_cli.servers import NatsServer
from reprise_cli.slurm import SlurmCluster, slurm_unavailable_reason
from reprise_orchestrator.settings import OrchestratorSettings

SLURM_NODES = 5  # the demo's 4 nodes and 1 spare
POSTGRES_ADMIN_URL = os.environ.get("REPRISE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A real nats-server with JetStream on free ports, its store and log under the test's temp dir."""
    server = NatsServer.start_on_free_ports(tmp_path / "nats")
    yield server
    server.stop()


@pytest.fixture
def start_secured_nats(tmp_path: Path) -> Iterator[Callable[[Credentials], NatsServer]]:
    """Start a nats-server admitting the identities `reprise creds` made (its accounts and permissions); each one
    started is stopped at the end of the test."""
    started: list[NatsServer] = []

    def start(creds: Credentials) -> NatsServer:
        server = NatsServer.start_on_free_ports(tmp_path / f"secured-nats-{len(started)}", config=creds.server_config)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real Redis-compatible server on a free port."""
    server = RedisServer.start_on_free_port(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture
def key_authority(nats_server: NatsServer, redis_server: RedisServer, tmp_path: Path) -> OrchestratorSettings:
    """Settings of an orchestrator on the test's servers, the key authority for other services: a fresh admin key,
    its database `<tmp>/orchestrator.db`."""
    return OrchestratorSettings(
        nats_url=nats_server.url,
        redis_url=redis_server.url,
        database_url=f"sqlite:///{tmp_path / 'orchestrator.db'}",
        admin_api_key=secrets.token_urlsafe(32),
    )


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh SQLite database file for one test."""
    return f"sqlite:///{tmp_path / 'test.db'}"


def _postgres_database() -> Iterator[str]:
    name = f"reprise_test_{uuid.uuid4().hex[:12]}"
    try:
        admin = psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        pytest.skip(f"PostgreSQL path not tested: no server at {POSTGRES_ADMIN_URL} ({str(exc).strip()[:80]})")
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base = POSTGRES_ADMIN_URL.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database on the reachable server, dropped afterwards; skipped with the reason if none."""
    yield from _postgres_database()


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Each SQL backend in turn: SQLite always, PostgreSQL where a server is reachable."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'test.db'}"
    else:
        yield from _postgres_database()


@pytest.fixture(scope="session")
def slurm_session_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A real Slurm cluster (a controller and 5 slurmd, on free ports) started once for the whole session; skipped,
    with the reason, where Slurm is not installed (`make slurm-deps` installs it as root) or we are not root."""
    reason = slurm_unavailable_reason()
    if reason is not None:
        pytest.skip(f"Slurm tests not run: {reason}")
    cluster = SlurmCluster.start_on_free_ports(tmp_path_factory.mktemp("slurm"), nodes=SLURM_NODES)
    yield cluster
    cluster.stop()


@pytest.fixture
def slurm_cluster(slurm_session_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The session's Slurm cluster with every node idle and no job (a node the load made miss its pings is back), and
    put back so after the test (a slurmd or the controller it stopped runs again, its drains are lifted)."""
    slurm_session_cluster.reset()
    yield slurm_session_cluster
    slurm_session_cluster.reset()
