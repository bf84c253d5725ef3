"""The one logger setup: structured records, JSON in production, readable text for people."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from reprise_common.clock import utcnow

_STANDARD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line with the record's extra fields at top level."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        """Render a record as a JSON line."""
        payload: dict[str, Any] = {
            "time": utcnow().isoformat(),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                payload[key] = value
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


class TextFormatter(logging.Formatter):
    """Human-readable lines with extra fields appended as key=value."""

    def __init__(self, service: str) -> None:
        super().__init__("%(asctime)s %(levelname)-7s " + service + " %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        """Render a record as a text line."""
        line = super().format(record)
        extras = [f"{k}={v}" for k, v in record.__dict__.items() if k not in _STANDARD_ATTRS and not k.startswith("_")]
        return line + (" " + " ".join(extras) if extras else "")


def configure_logging(service: str, *, level: str = "INFO", fmt: str = "json") -> None:
    """Install one handler on the root logger, replacing any earlier one."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "nats"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def get_logger(name: str) -> logging.Logger:
    """A named logger; configure_logging decides where it goes."""
    return logging.getLogger(name)
