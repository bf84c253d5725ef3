"""The JSON body of a generic webhook request: every alert of one send, each with its delivery id.

A receiver deduplicates on `alerts[].id` (stable per event and destination: a retried request repeats it) and
verifies the body with `reprise_notifier.signing.verify` before parsing it.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from reprise_notifier.alerts.models import Item

BODY_VERSION = 1


def render(items: list[Item], *, message_id: str, sent_at: datetime) -> dict[str, Any]:
    """The webhook body: version, message id, when it was sent, and the alerts oldest first."""
    return {
        "version": BODY_VERSION,
        "type": "reprise.alerts",
        "message_id": message_id,
        "sent_at": sent_at.isoformat(),
        "alerts": [{"id": delivery_id, **alert.model_dump(mode="json")} for delivery_id, alert in items],
    }


def encode(body: dict[str, Any]) -> bytes:
    """Compact JSON bytes: exactly what is signed and sent."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
