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


class AdvisoryClient(BaseModel):
    """The client an advisory is about."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: int = Field(ge=0)  # the server's connection id
    user: str = Field(default="", max_length=128)  # who it authenticated as: an NKey user's public key
    name: str = Field(default="", max_length=256)  # what the client calls itself (not an identity)


class ClientAdvisory(BaseModel):
    """A client connected or disconnected."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    type: str = Field(max_length=128)
    id: str = Field(min_length=1, max_length=64)
    client: AdvisoryClient
    reason: str = Field(default="", max_length=256)

    @property
    def disconnected(self) -> bool:
        """True for a closed connection, False for a new one."""
        return self.type == DISCONNECT


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
