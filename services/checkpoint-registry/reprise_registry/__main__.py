"""Entry point: `reprise-registry` or `python -m reprise_registry`."""

from __future__ import annotations

from reprise_common.logging import configure_logging
from reprise_common.service import run_http_service
from reprise_registry.app import create_app
from reprise_registry.settings import RegistrySettings


def main() -> None:
    """Run the registry until SIGTERM."""
    settings = RegistrySettings()
    configure_logging("checkpoint-registry", level=settings.log_level, fmt=settings.log_format)
    run_http_service(create_app(settings), settings)


if __name__ == "__main__":
    main()
