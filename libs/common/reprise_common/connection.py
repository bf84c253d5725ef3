"""One service's connection to NATS: opening it, and the protocol through which the bus's consumers and followers
use it (they are handed the bus, reprise_common.bus.Bus, and never import it)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import nats
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from reprise_common.errors import BusError


class Connection(Protocol):
    """One service's connection to NATS, as a durable consumer or a snapshot follower needs it."""

    @property
    def nc(self) -> Client:
        """The underlying client; raises BusError before connect()."""

    @property
    def js(self) -> JetStreamContext:
        """The JetStream context; raises BusError before connect()."""

    @property
    def service(self) -> str:
        """The service this connection belongs to (a label of its metrics)."""

    @property
    def generation(self) -> int:
        """Bumped on every (re)connect, so that a reader rebuilds its subscription."""

    async def dead_letter(
        self, *, consumer: str, subject: str, data: bytes, reason: str, key: str, delivered: int
    ) -> None:
        """Keep a message that cannot be used, with the reason, on the dead-letter stream, and count it."""


async def open_connection(
    url: str, *, name: str, options: Callable[[], Mapping[str, Any]], attempts: int | None, retry_s: float
) -> Client:
    """Connect to a server, or a cluster's members comma-separated, retrying while none is up (BusError after
    `attempts` tries); the client reconnects forever after. `options` (callbacks, identity) is read at each try."""
    tries = 0
    while True:
        tries += 1
        try:
            return await nats.connect(
                servers=[server.strip() for server in url.split(",")],
                name=name,
                connect_timeout=2,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                ping_interval=2,
                max_outstanding_pings=2,
                **options(),
            )
        except (OSError, nats.errors.NoServersError, TimeoutError) as exc:
            if attempts is not None and tries >= attempts:
                raise BusError(f"cannot reach NATS at {url}: {exc}") from exc
            await asyncio.sleep(retry_s)
