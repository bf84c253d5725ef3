"""Every table the detector owns, created together."""

from __future__ import annotations

from sqlalchemy.engine import Engine

from reprise_detector.incidents.models import create_tables as create_incident_tables
from reprise_detector.nodes.models import create_tables as create_node_tables


def create_tables(engine: Engine) -> None:
    """Create the incident, symptom, node fault, quarantine and hang policy tables if missing."""
    create_incident_tables(engine)
    create_node_tables(engine)
