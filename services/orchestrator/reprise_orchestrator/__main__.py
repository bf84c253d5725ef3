"""Entry point: `reprise-orchestrator` or `python -m reprise_orchestrator`."""

from __future__ import annotations

from reprise_common.logging import configure_logging
from reprise_common.service import run_http_service
from reprise_orchestrator.app import create_app
from reprise_orchestrator.settings import OrchestratorSettings


def main() -> None:
    """Run one orchestrator replica until SIGTERM."""
    settings = OrchestratorSettings()
    configure_logging("orchestrator", level=settings.log_level, fmt=settings.log_format)
    run_http_service(create_app(settings), settings)


if __name__ == "__main__":
    main()
