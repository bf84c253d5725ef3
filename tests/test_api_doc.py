"""docs/api.md names every route each service serves, so the document cannot fall behind the code."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI

from reprise_agent.app import create_app as agent_app
from reprise_agent.settings import AgentSettings
from reprise_dashboard.app import create_app as dashboard_app
from reprise_dashboard.settings import DashboardSettings
from reprise_detector.app import create_app as detector_app
from reprise_detector.settings import DetectorSettings
from reprise_notifier.app import create_app as notifier_app
from reprise_notifier.settings import NotifierSettings
from reprise_orchestrator.app import create_app as orchestrator_app
from reprise_orchestrator.settings import OrchestratorSettings
from reprise_registry.app import create_app as registry_app
from reprise_registry.settings import RegistrySettings

DOC = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()


def _apps(tmp: Path) -> dict[str, FastAPI]:
    return {
        "orchestrator": orchestrator_app(OrchestratorSettings(database_url=f"sqlite:///{tmp / 'o.db'}")),
        "detector": detector_app(DetectorSettings(database_url=f"sqlite:///{tmp / 'd.db'}")),
        "registry": registry_app(RegistrySettings(database_url=f"sqlite:///{tmp / 'r.db'}")),
        "agent": agent_app(AgentSettings(node_id="doc-node", state_dir=tmp / "agent")),
        "notifier": notifier_app(NotifierSettings(database_url=f"sqlite:///{tmp / 'n.db'}")),
        "dashboard": dashboard_app(DashboardSettings()),
    }


@pytest.mark.parametrize("service", ["orchestrator", "detector", "registry", "agent", "notifier", "dashboard"])
def test_every_route_is_documented(service: str, tmp_path: Path) -> None:
    paths = _apps(tmp_path)[service].openapi()["paths"]
    missing = [
        f"{method.upper()} {path}"
        for path, operations in paths.items()
        if path not in ("/healthz", "/readyz", "/metrics")
        for method in operations
        if f"| {method.upper()} | `{path}` |" not in DOC
    ]
    assert missing == [], f"docs/api.md lacks: {missing}"
