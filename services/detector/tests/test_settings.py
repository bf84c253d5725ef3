"""Detector settings: defaults, the REPRISE_ prefix, and a rules file that must exist."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from reprise_detector.settings import DetectorSettings


def test_defaults_and_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("REPRISE_HTTP_PORT", "REPRISE_INCIDENT_WINDOW_S", "REPRISE_RULES_PATH", "REPRISE_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    defaults = DetectorSettings()
    assert (defaults.http_port, defaults.incident_window_s, defaults.rules_path) == (8720, 60.0, None)

    rules = tmp_path / "rules.yaml"
    rules.write_text("version: 1\n")
    monkeypatch.setenv("REPRISE_INCIDENT_WINDOW_S", "90")
    monkeypatch.setenv("REPRISE_RULES_PATH", str(rules))
    monkeypatch.setenv("REPRISE_DATABASE_URL", "postgresql://db/reprise")
    settings = DetectorSettings()
    assert (settings.incident_window_s, settings.rules_path) == (90.0, rules)
    assert settings.database_url == "postgresql://db/reprise"


@pytest.mark.parametrize(
    ("field", "value"),
    [("rules_path", "/nonexistent/rules.yaml"), ("incident_window_s", "0"), ("database_url", "mysql://x")],
)
def test_bad_values_are_refused(field: str, value: str) -> None:
    with pytest.raises(ValidationError, match=field):
        DetectorSettings(**{field: value})
