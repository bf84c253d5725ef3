"""Agents' NATS connections, as the server reports them: the close of a node's last connection makes it suspect.

The server publishes a client advisory whenever a client of Reprise's account connects or its connection closes
(subjects.CLIENT_EVENTS, imported from the system account; only the detector may read them). The client is named by
the public key it authenticated with, which the credentials tie to one node (`reprise creds` writes the map of agent
keys to nodes, REPRISE_NODE_KEYS_FILE); the name a client gives itself is not trusted.

A node may hold several connections with its identity (its agent's, one it reconnected on, an operator's tool using
the node's credentials), so one closing says little. A close makes the node suspect only when it is the connection the
node's reports say they are sent on (or, before any report said so, the last one known to be live), no connection with
its identity opened since is still live, and the reason says the client's end went away (CLIENT_GONE: a killed agent
or host). A server shutting down, a slow consumer or a stale connection is the server's decision about a client that
may be alive: no evidence (the node's silence, and its jobs' other ranks, tell). Nor is any client that is not an agent.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from nats.aio.msg import Msg
from prometheus_client import Counter

from reprise_common import subjects
from reprise_common.advisories import ClientAdvisory, read_advisory
from reprise_common.clock import Clock
from reprise_common.errors import ConfigError, MalformedEventError
from reprise_common.logging import get_logger
from reprise_detector.nodes.liveness import Liveness

log = get_logger("reprise.detector.connections")
MAX_KEYS_FILE_BYTES = 16 * 1024 * 1024
RELOAD_EVERY_S = 10.0  # an unknown key reloads the map at most this often (a node added with `reprise creds`)
ADVISORIES = Counter(
    "reprise_detector_client_advisories_total", "NATS client advisories read, by what they meant", ["kind"]
)


def read_node_keys(path: Path) -> dict[str, str]:
    """The map of agent public keys to node ids; ConfigError when the file is unusable."""
    try:
        data = path.read_bytes()
        if len(data) > MAX_KEYS_FILE_BYTES:
            raise ConfigError(f"{path}: {len(data)} bytes, above {MAX_KEYS_FILE_BYTES}")
        keys = json.loads(data)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the node keys file {path}: {exc}") from exc
    if not isinstance(keys, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
        raise ConfigError(f"{path}: expected an object of public key to node id")
    try:
        return {key: subjects.token(node) for key, node in keys.items()}
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


class Connections:
    """Turns client advisories into Liveness calls; `wake` is called when a node became suspect."""

    def __init__(self, *, liveness: Liveness, keys_file: Path, clock: Clock, wake: Callable[[], None]) -> None:
        self.liveness = liveness
        self.keys_file = keys_file
        self.clock = clock
        self.wake = wake
        self.keys = read_node_keys(keys_file)
        self.malformed = 0
        self._loaded_at = clock.monotonic()
        # node -> its connections known to be live that opened since its reports last named a new one (bounded: one
        # entry per open connection of the node, reset whenever its reports move to a new connection)
        self.live: dict[str, set[str]] = {}
        self._reported_on: dict[str, str] = {}  # node -> the connection its reports named when `live` was last reset

    async def on_message(self, msg: Msg) -> None:
        """One advisory (core NATS subscription callback)."""
        try:
            advisory = read_advisory(msg.data)
        except MalformedEventError as exc:
            self.malformed += 1
            ADVISORIES.labels("malformed").inc()
            log.warning("ignoring a malformed client advisory", extra={"subject": msg.subject, "reason": str(exc)})
            return
        node_id = self._node(advisory.client.user)
        if node_id is None:
            ADVISORIES.labels("not an agent").inc()
            return
        live = self._live(node_id)
        if not advisory.disconnected:
            ADVISORIES.labels("connected").inc()
            live.add(advisory.connection)
            self.liveness.connected(node_id)
            return
        live.discard(advisory.connection)
        kind = self._judge_close(node_id, advisory, live)
        ADVISORIES.labels(kind).inc()
        if kind == "dropped" and self.liveness.dropped(node_id, advisory_id=advisory.id, reason=advisory.reason):
            log.info("agent connection closed", extra={"node_id": node_id, "reason": advisory.reason})
            self.wake()
        elif kind != "dropped":
            log.info(
                "a connection with a node's identity closed: no evidence",
                extra={"node_id": node_id, "reason": advisory.reason, "why": kind},
            )

    def _live(self, node_id: str) -> set[str]:
        """The node's live connections opened since its reports last named a new one."""
        reporting = self.liveness.reporting_connection(node_id)
        if reporting and self._reported_on.get(node_id) != reporting:
            self._reported_on[node_id] = reporting
            self.live[node_id] = {reporting}  # earlier ones are either closed or not the agent's
        return self.live.setdefault(node_id, set())

    def _judge_close(self, node_id: str, advisory: ClientAdvisory, live: set[str]) -> str:
        """What one closed connection of a node means (the metric's kind): "dropped" when it makes the node suspect."""
        reporting = self.liveness.reporting_connection(node_id)
        if reporting and advisory.connection != reporting:
            return "not its reporting connection"
        if live:
            return "another connection is live"
        if not advisory.client_gone:
            return "closed by the server"
        return "dropped"

    def _node(self, key: str) -> str | None:
        node_id = self.keys.get(key)
        if node_id is None and key and self.clock.monotonic() - self._loaded_at >= RELOAD_EVERY_S:
            self._loaded_at = self.clock.monotonic()
            try:
                self.keys = read_node_keys(self.keys_file)
            except ConfigError as exc:
                log.warning("node keys not reloaded", extra={"error": str(exc)})
            node_id = self.keys.get(key)
        return node_id
