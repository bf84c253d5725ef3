"""Auth side effects at start: the bootstrap admin key from the settings."""

from __future__ import annotations

from sqlmodel import Session

from reprise_common.auth import Scope
from reprise_common.logging import get_logger
from reprise_orchestrator.auth import service
from reprise_orchestrator.deps import Deps

log = get_logger("reprise.orchestrator.auth")


def bootstrap(deps: Deps) -> None:
    """Make REPRISE_ADMIN_API_KEY an admin key and REPRISE_READ_API_KEY a read key (idempotent), and say so when
    nobody could administer keys."""
    settings = deps.settings
    chosen = (
        (settings.admin_api_key, service.BOOTSTRAP_ID, Scope.ADMIN),
        (settings.read_api_key, service.BOOTSTRAP_READ_ID, Scope.READ),
    )
    with Session(deps.engine) as session:
        for secret, key_id, scope in chosen:
            if secret is None:
                continue
            row = service.ensure_bootstrap(
                session, key=secret.get_secret_value(), now=deps.clock.now(), key_id=key_id, scope=scope
            )
            if row.revoked_at is not None:
                log.warning("a bootstrap key is revoked: set a new value to replace it", extra={"key_id": key_id})
        if settings.auth_enabled and service.count_live_admins(session) == 0:
            log.warning("no live admin API key: set REPRISE_ADMIN_API_KEY to create and manage keys")
