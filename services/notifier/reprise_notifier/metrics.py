"""The notifier's Prometheus metrics; destinations are labelled by name, never by URL."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

ALERTS_QUEUED = Counter(
    "reprise_notifier_alerts_queued_total",
    "Alerts put in the outbox (a redelivered event adds none)",
    ["destination", "kind"],
)
SENDS = Counter(
    "reprise_notifier_sends_total", "Requests to destinations, by how they were answered", ["destination", "result"]
)
ALERTS_SENT = Counter("reprise_notifier_alerts_sent_total", "Alerts a destination accepted", ["destination"])
DEAD_LETTERS = Counter(
    "reprise_notifier_dead_letters_total", "Alerts given up on, by reason", ["destination", "reason"]
)
PENDING = Gauge("reprise_notifier_pending", "Alerts waiting in the outbox", ["destination"])
