"""Run the detector: `reprise-detector` or `python -m reprise_detector`."""

from __future__ import annotations

from reprise_common.logging import configure_logging
from reprise_common.service import run_http_service
from reprise_detector.app import create_app
from reprise_detector.settings import DetectorSettings


def main() -> None:
    """Read settings from the environment and serve until SIGTERM."""
    settings = DetectorSettings()
    configure_logging("detector", level=settings.log_level, fmt=settings.log_format)
    run_http_service(create_app(settings), settings)


if __name__ == "__main__":
    main()
