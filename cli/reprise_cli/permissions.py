"""What each NATS identity may publish and subscribe to, as the server enforces it (`reprise creds` writes it).

Each service gets only the subjects its code uses: only the orchestrator commands agents (`reprise.cmd.*`,
`reprise.inject.*`) and answers API key checks, only the detector opens incidents and recommends quarantines, each
agent uses only its own node's subjects. JetStream is reached through `$JS.API.*` subjects: each service may manage
only its own durable consumers (info, create, pull, ack) and, because every service's bus provisions every stream
when it connects (the first to start creates them), create Reprise's streams by name; only the streams' owner (the
orchestrator) may update one (a newer release's configuration). Nothing but the admin identity (operator tools,
tests) may use every subject.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reprise_common import subjects

JS_API = "$JS.API"
COMMANDS_ALL = f"{subjects.PREFIX}.cmd.*"
INJECTS_ALL = f"{subjects.PREFIX}.inject.*"


@dataclass(frozen=True)
class Durable:
    """A durable pull consumer a service reads a stream through."""

    stream: str
    name: str  # "*" where replicas name their own (the detector's `<base>-p<index>of<count>`)
    deleted_at_start: bool = False  # the service deletes it first (the detector replays placements at each start)


@dataclass(frozen=True)
class Grant:
    """What one service's code does on NATS, from which its permissions follow."""

    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()  # core NATS subscriptions besides the reply inbox
    durables: tuple[Durable, ...] = ()
    stream_info: tuple[str, ...] = ()  # streams whose state it reads
    answers: bool = False  # it serves requests: it may reply to the ones it received, and to no other inbox


# API keys are checked with the orchestrator (the key authority) over `reprise.auth.verify`: only it may receive the
# checks (anyone answering them could grant any scope), every other HTTP service may ask.
KEY_CHECKS = subjects.AUTH_VERIFY

# The durable names are the services' own constants (their app and runtime modules): cli/tests/test_service_jetstream.py
# reads through each with those constants, so a renamed one fails there.
SERVICES: dict[str, Grant] = {
    "checkpoint-registry": Grant(
        publish=(subjects.CHECKPOINTS_ALL, subjects.dead_letter("checkpoint-registry"), KEY_CHECKS),
        durables=(
            Durable(subjects.PLACEMENTS_STREAM, "registry-placements"),
            Durable(subjects.AGENT_STREAM, "registry-checkpoints"),
        ),
    ),
    "detector": Grant(
        publish=(subjects.INCIDENTS_ALL, subjects.NODE_QUARANTINE_ALL, subjects.dead_letter("detector"), KEY_CHECKS),
        subscribe=(subjects.AGENT_REPORTS, *subjects.CLIENT_EVENTS),  # reports; agents' connections (alone)
        durables=(
            Durable(subjects.PLACEMENTS_STREAM, "*", deleted_at_start=True),
            Durable(subjects.AGENT_STREAM, "*", deleted_at_start=True),  # it also drops its retired reports consumer
            Durable(subjects.RECOVERIES_STREAM, "*"),  # a recovery that succeeded mitigates its incident
            Durable(subjects.COMPUTE_STREAM, "*"),  # the compute backend's failure signals are symptoms
        ),
        stream_info=(subjects.PLACEMENTS_STREAM,),
    ),
    "orchestrator": Grant(
        publish=(
            COMMANDS_ALL,
            INJECTS_ALL,  # drills
            subjects.PLACEMENTS_ALL,
            subjects.RECOVERIES_ALL,
            subjects.COMPUTE_SIGNALS_ALL,
            subjects.dead_letter("orchestrator"),
        ),
        subscribe=(subjects.AGENT_REPORTS, KEY_CHECKS),  # the node inventory; the key authority
        durables=(
            Durable(subjects.INCIDENTS_STREAM, "orchestrator-incidents"),
            Durable(subjects.INCIDENTS_STREAM, "orchestrator-incident-updates"),
            Durable(subjects.NODES_STREAM, "orchestrator-quarantine"),
        ),
        answers=True,
    ),
    "notifier": Grant(
        publish=(subjects.dead_letter("notifier"), KEY_CHECKS),
        durables=(
            Durable(subjects.INCIDENTS_STREAM, "notifier-incidents"),
            Durable(subjects.RECOVERIES_STREAM, "notifier-recoveries"),
        ),
    ),
    "dashboard": Grant(publish=(KEY_CHECKS,), subscribe=(subjects.INCIDENTS_ALL, subjects.RECOVERIES_ALL)),  # live feed
}


def provisioning(*, owner: bool) -> list[str]:
    """The API subjects that create each stream, by name, and for the streams' owner (subjects.STREAMS_OWNER) also
    update it (and purge what an older release stored under a retired subject): no other stream, and no deletion."""
    allowed: list[str] = []
    for spec in subjects.STREAMS:
        allowed.append(f"{JS_API}.STREAM.CREATE.{spec.name}")
        if owner:
            allowed.append(f"{JS_API}.STREAM.UPDATE.{spec.name}")
            if spec.retired_subjects:
                allowed.append(f"{JS_API}.STREAM.PURGE.{spec.name}")
    return allowed


def consumer_subjects(durable: Durable) -> list[str]:
    """Look up, create (nats-py's durable form), pull from and acknowledge one durable consumer."""
    stream, name = durable.stream, durable.name
    allowed = [
        f"{JS_API}.CONSUMER.INFO.{stream}.{name}",
        f"{JS_API}.CONSUMER.DURABLE.CREATE.{stream}.{name}",
        f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.{name}",
        f"$JS.ACK.{stream}.{name}.>",
    ]
    if durable.deleted_at_start:
        allowed.append(f"{JS_API}.CONSUMER.DELETE.{stream}.{name}")
    return allowed


def service_permissions(service: str) -> dict[str, Any]:
    """The server permissions of one platform service's identity; KeyError for a name that is not a service."""
    grant = SERVICES[service]
    owner = service == subjects.STREAMS_OWNER
    publish = [
        *grant.publish,
        *provisioning(owner=owner),
        *(f"{JS_API}.STREAM.INFO.{name}" for name in grant.stream_info),
    ]
    for durable in grant.durables:
        publish += consumer_subjects(durable)
    # Its own reply inbox only: JetStream API answers, publish acks, pull batches, command replies, key checks
    inbox = f"{subjects.inbox_prefix(service)}.>"
    permissions: dict[str, Any] = {"publish": {"allow": publish}, "subscribe": {"allow": [*grant.subscribe, inbox]}}
    if grant.answers:
        permissions["allow_responses"] = True
    return permissions


def agent_permissions(node_id: str) -> dict[str, Any]:
    """What one node's agent may do: publish its own reports and events, receive its own commands, answer them."""
    return {
        "publish": {"allow": [f"{subjects.PREFIX}.agent.{subjects.token(node_id)}.>"]},
        "subscribe": {
            "allow": [
                subjects.node_command(node_id),
                subjects.node_inject(node_id),
                f"{subjects.inbox_prefix(node_id)}.>",
            ]
        },
        "allow_responses": True,
    }
