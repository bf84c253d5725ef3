"""Prometheus metrics shared by every service (one registry per process)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

EVENTS_PUBLISHED = Counter(
    "reprise_events_published_total",
    "Events published (JetStream, or core NATS for snapshots)",
    ["service", "subject_kind"],
)
EVENTS_CONSUMED = Counter(
    "reprise_events_consumed_total",
    "Events taken from a durable consumer, by outcome",
    ["service", "consumer", "outcome"],
)
DEAD_LETTERS = Counter(
    "reprise_dead_letters_total",
    "Messages dead-lettered instead of processed",
    ["service", "consumer", "reason_kind"],
)
SNAPSHOTS = Counter(
    "reprise_snapshots_total",
    "Snapshots (e.g. node reports) from a core NATS subscription: handled, or superseded by a newer one of the same"
    " subject before the handler got to it",
    ["service", "subject_kind", "outcome"],
)
SLOW_CONSUMER_DROPS = Counter(
    "reprise_bus_slow_consumer_dropped_total",
    "Core NATS messages the client dropped because a subscription's pending limits were reached",
    ["service", "subject_kind"],
)
BUS_CONNECTED = Gauge("reprise_bus_connected", "1 while connected to NATS", ["service"])
BUS_RECONNECTS = Counter("reprise_bus_reconnects_total", "Reconnections to NATS", ["service"])


def subject_kind(subject: str) -> str:
    """A low-cardinality label for a subject: its tokens with ids removed (e.g. reprise.agent.report)."""
    parts = subject.split(".")
    if len(parts) >= 3 and parts[1] in {"agent", "incident", "placement", "recovery", "cmd", "inject"}:
        return ".".join([parts[0], parts[1], *parts[3:]])
    return subject
