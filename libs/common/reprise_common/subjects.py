"""Every NATS subject and JetStream stream Reprise uses, defined in this one place.

Node identity comes from the subject (which the server's permissions tie to the node's credentials), never from a
payload field. Subject tokens are validated so that a node or job id can never inject wildcards.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PREFIX = "reprise"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def token(value: str) -> str:
    """Return value if it is safe as one subject token (no dots, spaces or wildcards), else raise ValueError."""
    if not _TOKEN.match(value):
        raise ValueError(f"{value!r} is not a valid id: use 1-64 letters, digits, '_' or '-'")
    return value


# --- agents -> platform (reports: core NATS, not stored; events: JetStream, stream AGENT) ---------------------
def node_report(node_id: str) -> str:
    """The per-interval compact report of one node: a snapshot, published on core NATS (only the latest counts)."""
    return f"{PREFIX}.agent.{token(node_id)}.report"


def node_event(node_id: str, event_type: str) -> str:
    """A discrete event from one node, e.g. gpu.xid or rank.exited."""
    return f"{PREFIX}.agent.{token(node_id)}.event.{event_type}"


AGENT_REPORTS = f"{PREFIX}.agent.*.report"
AGENT_EVENTS = f"{PREFIX}.agent.*.event.>"
AGENT_CHECKPOINTS_SAVED = f"{PREFIX}.agent.*.event.checkpoint.saved"


def node_from_agent_subject(subject: str) -> str:
    """The node id carried by an agent subject (the second token after the prefix)."""
    parts = subject.split(".")
    if len(parts) < 4 or parts[0] != PREFIX or parts[1] != "agent":
        raise ValueError(f"not an agent subject: {subject}")
    return token(parts[2])


# --- the NATS server's own events (system account, imported into Reprise's account) ----------------------------
STREAMS_OWNER = "orchestrator"  # the one identity that updates the streams' configuration; others only create
NATS_ACCOUNT = "REPRISE"  # the server account every Reprise identity belongs to (with credentials)
NATS_SYSTEM_ACCOUNT = "SYS"
CLIENT_CONNECTED = f"$SYS.ACCOUNT.{NATS_ACCOUNT}.CONNECT"  # the server's advisory: a client of the account connected
CLIENT_DISCONNECTED = f"$SYS.ACCOUNT.{NATS_ACCOUNT}.DISCONNECT"  # ... its connection closed, and why
CLIENT_EVENTS = (CLIENT_CONNECTED, CLIENT_DISCONNECTED)


# --- platform -> agents (core NATS request/reply; not stored) -------------------------------------------------
def node_command(node_id: str) -> str:
    """Fenced commands for one node's agent (launch, stop, ping); the agent replies to each."""
    return f"{PREFIX}.cmd.{token(node_id)}"


def inbox_prefix(identity: str) -> str:
    """The reply-inbox prefix of one NATS identity (a service, or a node's agent), so that its permissions confine it
    to its own replies: no one reads the answers meant for another (node ids may not be service names)."""
    return f"_INBOX_{token(identity)}"


def node_inject(node_id: str) -> str:
    """Fault injection into one node's simulated GPUs (tests, demo, drills)."""
    return f"{PREFIX}.inject.{token(node_id)}"


# --- detector -> platform (JetStream, stream INCIDENTS) -------------------------------------------------------
def incident(job_id: str, change: str) -> str:
    """An incident change for a job: opened, updated or resolved."""
    return f"{PREFIX}.incident.{token(job_id)}.{token(change)}"


INCIDENTS_ALL = f"{PREFIX}.incident.>"
INCIDENTS_OPENED = f"{PREFIX}.incident.*.opened"
INCIDENTS_UPDATED = f"{PREFIX}.incident.*.updated"


# --- orchestrator -> platform (JetStream) ---------------------------------------------------------------------
def placement(job_id: str) -> str:
    """The current placement (rank map) of a job; the stream keeps the last one per job."""
    return f"{PREFIX}.placement.{token(job_id)}"


PLACEMENTS_ALL = f"{PREFIX}.placement.>"


def recovery(job_id: str, change: str) -> str:
    """A recovery change for a job: started, step, succeeded or failed."""
    return f"{PREFIX}.recovery.{token(job_id)}.{token(change)}"


RECOVERIES_ALL = f"{PREFIX}.recovery.>"


def compute_signal(backend: str) -> str:
    """A failure signal of a compute backend (a cluster scheduler), announced by the orchestrator running it."""
    return f"{PREFIX}.compute.{token(backend)}.signal"


COMPUTE_SIGNALS_ALL = f"{PREFIX}.compute.*.signal"


# --- detector -> orchestrator (JetStream, stream NODES) -------------------------------------------------------
def node_quarantine(node_id: str) -> str:
    """A recommendation to quarantine a node (its fault history across jobs says it is a lemon)."""
    return f"{PREFIX}.node.{token(node_id)}.quarantine"


NODE_QUARANTINE_ALL = f"{PREFIX}.node.*.quarantine"


# --- checkpoint registry -> platform (JetStream, stream CHECKPOINTS) --------------------------------------------
def checkpoint(job_id: str, change: str) -> str:
    """A checkpoint change for a job: validated, corrupt or deleted."""
    return f"{PREFIX}.checkpoint.{token(job_id)}.{token(change)}"


CHECKPOINTS_ALL = f"{PREFIX}.checkpoint.>"


# --- API keys -------------------------------------------------------------------------------------------------
# Key checks, answered by the key authority (the orchestrator's replicas, one queue group): core NATS request.
AUTH_VERIFY = f"{PREFIX}.auth.verify"
AUTH_VERIFY_QUEUE = "key-authority"


# --- dead letters ---------------------------------------------------------------------------------------------


def dead_letter(service: str) -> str:
    """Where a service puts messages it could not parse, with the reason."""
    return f"{PREFIX}.deadletter.{token(service)}"


DEAD_LETTERS_ALL = f"{PREFIX}.deadletter.>"


# --- stream names: the only place they are spelled --------------------------------------------------------------
AGENT_STREAM = "AGENT"
INCIDENTS_STREAM = "INCIDENTS"
PLACEMENTS_STREAM = "PLACEMENTS"
RECOVERIES_STREAM = "RECOVERIES"
CHECKPOINTS_STREAM = "CHECKPOINTS"
DEAD_LETTER_STREAM = "DEADLETTER"
NODES_STREAM = "NODES"
COMPUTE_STREAM = "COMPUTE"


@dataclass(frozen=True)
class StreamSpec:
    """A JetStream stream Reprise provisions (idempotently) at start."""

    name: str
    subjects: tuple[str, ...]
    max_age_s: float
    max_msgs_per_subject: int = -1
    duplicate_window_s: float = 120.0
    description: str = ""
    extra: dict[str, object] = field(default_factory=dict)
    retired_subjects: tuple[str, ...] = ()  # once stored here, no longer: purged when an older stream is updated


STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec(
        name=AGENT_STREAM,
        subjects=(AGENT_EVENTS,),
        max_age_s=3600.0,
        description="Discrete node events (XIDs, rank exits, dependency failures); node reports are core NATS.",
        retired_subjects=(AGENT_REPORTS,),
    ),
    StreamSpec(
        name=INCIDENTS_STREAM,
        subjects=(INCIDENTS_ALL,),
        max_age_s=7 * 86400.0,
        description="Incident opened / updated / resolved, from the detector.",
    ),
    StreamSpec(
        name=PLACEMENTS_STREAM,
        subjects=(PLACEMENTS_ALL,),
        max_age_s=30 * 86400.0,
        max_msgs_per_subject=1,
        description="The latest placement of each job (last value per subject).",
    ),
    StreamSpec(
        name=RECOVERIES_STREAM,
        subjects=(RECOVERIES_ALL,),
        max_age_s=7 * 86400.0,
        description="Recovery started / step / succeeded / failed, from the orchestrator.",
    ),
    StreamSpec(
        name=CHECKPOINTS_STREAM,
        subjects=(CHECKPOINTS_ALL,),
        max_age_s=7 * 86400.0,
        description="Checkpoint validated / corrupt / deleted, from the checkpoint registry.",
    ),
    StreamSpec(
        name=DEAD_LETTER_STREAM,
        subjects=(DEAD_LETTERS_ALL,),
        max_age_s=14 * 86400.0,
        description="Messages a consumer could not parse, with the reason and the raw payload.",
    ),
    StreamSpec(
        name=COMPUTE_STREAM,
        subjects=(COMPUTE_SIGNALS_ALL,),
        max_age_s=7 * 86400.0,
        description="Failure signals of the compute backend (node down, job preempted), from the orchestrator.",
    ),
    StreamSpec(
        name=NODES_STREAM,
        subjects=(NODE_QUARANTINE_ALL,),
        max_age_s=30 * 86400.0,
        description="Node quarantine recommendations from the detector's node reputation.",
    ),
)
