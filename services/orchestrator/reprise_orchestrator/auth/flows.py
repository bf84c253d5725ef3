"""Auth side effects at start: the bootstrap admin key from the settings."""

from __future__ import annotations

from sqlmodel import Session

from reprise_common.logging import get_logger
from reprise_orchestrator.auth import service
from reprise_orchestrator.deps import Deps

log = get_logger("reprise.orchestrator.auth")


def bootstrap(deps: Deps) -> None:
    """Make REPRISE_ADMIN_API_KEY an admin key (idempotent), and say so when nobody could administer keys."""
    settings = deps.settings
    with Session(deps.engine) as session:
        if settings.admin_api_key is not None:
            row = service.ensure_bootstrap(session, key=settings.admin_api_key.get_secret_value(), now=deps.clock.now())
            if row.revoked_at is not None:
                log.warning("the bootstrap admin key (REPRISE_ADMIN_API_KEY) is revoked: set a new value to replace it")
        if not settings.auth_enabled:
            log.warning("authentication is off (REPRISE_AUTH_ENABLED=false): every route is open; calls are audited")
        elif service.count_live_admins(session) == 0:
            log.warning("no live admin API key: set REPRISE_ADMIN_API_KEY to create and manage keys")
