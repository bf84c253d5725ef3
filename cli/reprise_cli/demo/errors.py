"""The demo's own error, below every other demo module."""

from __future__ import annotations

from reprise_common.errors import RepriseError


class DemoFailure(RepriseError):
    """The scenario could not go on: a fault was refused, or the platform did not do its part in time."""
