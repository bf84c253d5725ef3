"""The NATS server's client advisories that Reprise reads (subjects.CLIENT_EVENTS): a client connected, or its
connection closed and why. The server writes them (schema ``io.nats.server.advisory.v1.client_connect`` and
``client_disconnect``); only the fields Reprise uses are read, the rest ignored, each bounded."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reprise_common.errors import MalformedEventError

CONNECT = "io.nats.server.advisory.v1.client_connect"
DISCONNECT = "io.nats.server.advisory.v1.client_disconnect"
MAX_ADVISORY_BYTES = 64 * 1024
SERVER_SHUTDOWN = "Server Shutdown"  # the server going away: its clients reconnect to another, nothing was lost
# The reasons that say the client's end went away (its process closed the socket, or the socket broke under it): a
# killed agent reads so. Every other reason is the server's own decision about a client that may be alive (a slow
# consumer, a stale connection on a cut network, a limit): no evidence that the node is gone, its silence tells.
CLIENT_GONE = frozenset({"Client Closed", "Read Error"})


class AdvisoryClient(BaseModel):
    """The client an advisory is about."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: int = Field(ge=0)  # the server's connection id
    user: str = Field(default="", max_length=128)  # who it authenticated as: an NKey user's public key
    name: str = Field(default="", max_length=256)  # what the client calls itself (not an identity)


class AdvisoryServer(BaseModel):
    """The server that wrote an advisory (a client's id is unique on its server alone)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str = Field(default="", max_length=128)
    name: str = Field(default="", max_length=256)


class ClientAdvisory(BaseModel):
    """A client connected or disconnected."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    type: str = Field(max_length=128)
    id: str = Field(min_length=1, max_length=64)
    server: AdvisoryServer = Field(default_factory=AdvisoryServer)
    client: AdvisoryClient
    reason: str = Field(default="", max_length=256)

    @property
    def disconnected(self) -> bool:
        """True for a closed connection, False for a new one."""
        return self.type == DISCONNECT

    @property
    def connection(self) -> str:
        """The connection's name as a client reads it of itself (connection_name): server id / client id."""
        return connection_name(self.server.id, self.client.id)

    @property
    def client_gone(self) -> bool:
        """True when the reason says the client's end went away, not that the server dropped a live client."""
        return self.reason in CLIENT_GONE


def connection_name(server_id: str, client_id: int) -> str:
    """One connection's name, the same from the server's advisories and from the client's own view."""
    return f"{server_id}/{client_id}"


def read_advisory(data: bytes) -> ClientAdvisory:
    """Parse a connect or disconnect advisory; MalformedEventError for anything else."""
    if len(data) > MAX_ADVISORY_BYTES:
        raise MalformedEventError(f"advisory of {len(data)} bytes, above {MAX_ADVISORY_BYTES}")
    try:
        advisory = ClientAdvisory.model_validate_json(data)
    except ValidationError as exc:
        raise MalformedEventError(f"not a client advisory: {exc.errors()[0]['msg']}") from exc
    if advisory.type not in (CONNECT, DISCONNECT):
        raise MalformedEventError(f"not a client advisory: type {advisory.type!r}")
    return advisory
