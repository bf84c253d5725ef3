"""Run the notifier: `reprise-notifier` or `python -m reprise_notifier`."""

from __future__ import annotations

import sys

from reprise_common.errors import ConfigError
from reprise_common.logging import configure_logging
from reprise_common.service import run_http_service
from reprise_notifier.app import create_app
from reprise_notifier.settings import NotifierSettings


def main() -> None:
    """Read settings and routes from the environment and serve until SIGTERM; a bad routes file exits with 2."""
    settings = NotifierSettings()
    configure_logging("notifier", level=settings.log_level, fmt=settings.log_format)
    try:
        app = create_app(settings)
    except ConfigError as exc:
        print(f"reprise-notifier: {exc}", file=sys.stderr)
        sys.exit(2)
    run_http_service(app, settings)


if __name__ == "__main__":
    main()
