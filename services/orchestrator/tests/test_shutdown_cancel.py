"""A replica stops even when a client swallowed the cancel of its reconciler (real app, NATS, Redis, SQLite).

redis-py retries a read that a cancel interrupted, so a reconcile pass cancelled inside a Redis call can end as if
nothing had happened. The reconciler's loop must still end, or the replica's shutdown waits for ever (seen as
orchestrator tests hanging in their teardown once every pass made a Redis call).
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from pathlib import Path

from fastapi.testclient import TestClient

from reprise_cli.redis_server import RedisServer
from reprise_cli.servers import NatsServer
from reprise_orchestrator.app import create_app
from reprise_orchestrator.settings import OrchestratorSettings

STOP_WITHIN_S = 20.0


def test_the_replica_stops_when_a_reconcile_pass_swallowed_its_cancel(
    nats_server: NatsServer, redis_server: RedisServer, tmp_path: Path
) -> None:
    app = create_app(
        OrchestratorSettings(
            nats_url=nats_server.url,
            redis_url=redis_server.url,
            database_url=f"sqlite:///{tmp_path / 'o.db'}",
            admin_api_key=secrets.token_urlsafe(32),
        )
    )
    passes = threading.Event()

    async def pass_that_swallows_its_cancel() -> int:
        passes.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:  # what a client's retry does to a cancel that landed in its read
            return 0
        return 0

    app.state.reconciler.tick = pass_that_swallows_its_cancel
    client = TestClient(app)
    client.__enter__()
    assert passes.wait(timeout=15), "the reconciler never ran a pass"
    stopper = threading.Thread(target=client.__exit__, args=(None, None, None), daemon=True)
    stopper.start()
    stopper.join(timeout=STOP_WITHIN_S)
    assert not stopper.is_alive(), f"the replica did not stop within {STOP_WITHIN_S:g} s"
