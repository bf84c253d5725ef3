"""Entry point: `reprise-agent` or `python -m reprise_agent`."""

from __future__ import annotations

from reprise_agent.app import create_app
from reprise_agent.settings import AgentSettings
from reprise_common.logging import configure_logging
from reprise_common.service import run_http_service


def main() -> None:
    """Run one node's agent until SIGTERM."""
    settings = AgentSettings()  # node_id comes from REPRISE_NODE_ID
    configure_logging(f"agent-{settings.node_id}", level=settings.log_level, fmt=settings.log_format)
    run_http_service(create_app(settings), settings)


if __name__ == "__main__":
    main()
