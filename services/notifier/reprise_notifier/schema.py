"""Every table the notifier owns, created together (names prefixed notifier_: the database may be shared)."""

from __future__ import annotations

from sqlalchemy.engine import Engine

from reprise_notifier.alerts.models import create_tables as create_alert_tables
from reprise_notifier.deliveries.models import create_tables as create_delivery_tables


def create_tables(engine: Engine) -> None:
    """Create the incident, outbox, dead-letter and destination tables if missing."""
    create_alert_tables(engine)
    create_delivery_tables(engine)
