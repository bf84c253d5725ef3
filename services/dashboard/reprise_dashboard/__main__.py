"""Run the dashboard: `reprise-dashboard` or `python -m reprise_dashboard`."""

from __future__ import annotations

from reprise_common.logging import configure_logging
from reprise_common.service import run_http_service
from reprise_dashboard.app import create_app
from reprise_dashboard.settings import DashboardSettings


def main() -> None:
    """Read settings from the environment and serve until SIGTERM."""
    settings = DashboardSettings()
    configure_logging("dashboard", level=settings.log_level, fmt=settings.log_format)
    run_http_service(create_app(settings), settings)


if __name__ == "__main__":
    main()
