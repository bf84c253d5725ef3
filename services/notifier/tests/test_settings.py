"""Notifier settings: defaults, the REPRISE_ prefix, secrets that are required together, and errors that never echo
a webhook URL; a bad routes file stops the process at once with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from reprise_notifier.alerts.models import AlertKind
from reprise_notifier.settings import NotifierSettings

SECRET_URL = "https://hooks.slack.example/services/T1/B1/doNotShowMe"


def test_defaults_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("REPRISE_")]:
        monkeypatch.delenv(name)
    defaults = NotifierSettings()
    assert (defaults.http_port, defaults.slack_min_interval_s, defaults.notifier_slack_url) == (8740, 1.0, None)
    assert defaults.notifier_default_kinds == [AlertKind.OPENED, AlertKind.RECOVERED, AlertKind.FAILED]
    assert defaults.database_url == "sqlite:///.state/notifier.db"

    monkeypatch.setenv("REPRISE_NOTIFIER_SLACK_URL", SECRET_URL)
    monkeypatch.setenv("REPRISE_DASHBOARD_URL", "https://reprise.example/")
    monkeypatch.setenv("REPRISE_NOTIFIER_DEFAULT_KINDS", '["opened", "updated"]')
    settings = NotifierSettings()
    assert settings.notifier_slack_url is not None and settings.notifier_slack_url.get_secret_value() == SECRET_URL
    assert SECRET_URL not in repr(settings)
    assert settings.dashboard_url == "https://reprise.example"
    assert settings.notifier_default_kinds == [AlertKind.OPENED, AlertKind.UPDATED]
    monkeypatch.setenv("REPRISE_NOTIFIER_SLACK_URL", "")  # empty is unset, as compose writes it
    assert NotifierSettings().notifier_slack_url is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"notifier_slack_url": "ftp://x/doNotShowMe"}, "notifier_slack_url"),
        ({"notifier_webhook_url": SECRET_URL}, "REPRISE_NOTIFIER_WEBHOOK_SECRET is required"),
        ({"notifier_webhook_url": SECRET_URL, "notifier_webhook_secret": "changeme"}, "real secret"),
        ({"dashboard_url": "reprise.example"}, "dashboard_url"),
        ({"notifier_routes_file": "/nonexistent/routes.yaml"}, "notifier_routes_file"),
        ({"coalesce_max": 41}, "coalesce_max"),
        ({"retry_base_s": 10, "retry_max_s": 5}, "retry_max_s"),
        ({"notifier_default_kinds": ["paged"]}, "notifier_default_kinds"),
    ],
)
def test_bad_values_are_refused_without_echoing_them(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message) as refused:
        NotifierSettings(**fields)  # type: ignore[arg-type]
    assert "doNotShowMe" not in str(refused.value)


def test_a_bad_routes_file_stops_the_process_with_the_reason(tmp_path: Path) -> None:
    routes = tmp_path / "routes.yaml"
    routes.write_text(f"destinations:\n  ops: {{kind: slack, url: {SECRET_URL}}}\n")
    env = {**os.environ, "REPRISE_NOTIFIER_ROUTES_FILE": str(routes), "REPRISE_STATE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "reprise_notifier"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert "destination 'ops' has an inline url" in done.stderr
    assert "doNotShowMe" not in done.stderr + done.stdout
