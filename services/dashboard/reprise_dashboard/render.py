"""Server-side rendering: the Jinja2 templates, their filters, and one page response helper."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates
from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape

from reprise_common.clock import utcnow

PACKAGE_DIR = Path(__file__).resolve().parent
TEMPLATES_DIR = PACKAGE_DIR / "templates"
STATIC_DIR = PACKAGE_DIR / "static"
_URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)


def as_datetime(value: Any) -> datetime | None:
    """A datetime from a datetime or an ISO 8601 string (as services send them); None for anything else."""
    if isinstance(value, datetime):
        return value
    if isinstance(value, str) and value:
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            return None
    return None


def format_time(value: Any) -> str:
    """A UTC time to the second, e.g. 2026-01-01 12:00:03 UTC; '—' when there is none."""
    moment = as_datetime(value)
    if moment is None:
        return "—"
    return moment.astimezone(utcnow().tzinfo).strftime("%Y-%m-%d %H:%M:%S UTC")


def format_duration(seconds: Any) -> str:
    """Seconds for a person: 0.42 s, 12.3 s, 4 m 05 s, 2 h 03 m; '—' when unknown."""
    if seconds is None:
        return "—"
    value = float(seconds)
    if value < 10:
        return f"{value:.2f} s"
    if value < 60:
        return f"{value:.1f} s"
    if value < 3600:
        return f"{int(value // 60)} m {int(value % 60):02d} s"
    return f"{int(value // 3600)} h {int(value % 3600 // 60):02d} m"


def format_tick(seconds: float) -> str:
    """A time-axis mark: 0 s, 0.5 s, 30 s, 2 m, 1.5 h."""
    if seconds < 60:
        return f"{seconds:g} s"
    if seconds < 3600:
        return f"{seconds / 60:g} m"
    return f"{seconds / 3600:g} h"


def format_ago(value: Any) -> str:
    """How long ago a time was, e.g. '42 s ago'."""
    moment = as_datetime(value)
    if moment is None:
        return "—"
    return format_duration(max(0.0, (utcnow() - moment).total_seconds())) + " ago"


def format_percent(ratio: Any) -> str:
    """A fraction as a percentage with one decimal; '—' when unknown."""
    return "—" if ratio is None else f"{100 * float(ratio):.1f} %"


def hide_urls(text: Any) -> str:
    """Text with every URL replaced: alert details must never show a webhook URL, which is a secret."""
    return _URL.sub("[URL hidden]", str(text or ""))


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(TEMPLATES_DIR),
        autoescape=select_autoescape(default=True),
        undefined=StrictUndefined,  # a typo in a template fails the test that renders it, not silently
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        time=format_time,
        duration=format_duration,
        tick=format_tick,
        ago=format_ago,
        percent=format_percent,
        hide_urls=hide_urls,
    )
    return env


TEMPLATES = Jinja2Templates(env=_environment())


def page(request: Request, name: str, context: dict[str, Any], *, status_code: int = 200) -> HTMLResponse:
    """Render a page template with the context every page uses (now, the active section)."""
    return TEMPLATES.TemplateResponse(
        request, name, {"now": utcnow(), **context}, status_code=status_code, headers={"Cache-Control": "no-store"}
    )
