"""The orchestrator as key authority: it checks keys against its own table, for its routes and, over NATS, for every
other service (`reprise.auth.verify`, answered by one replica of the queue group)."""

from __future__ import annotations

import asyncio

from pydantic import ValidationError
from sqlalchemy.engine import Engine
from sqlmodel import Session

from reprise_common.auth import KeyCheck, KeyCheckAnswer, Principal, Scope, hash_key, key_id_of
from reprise_common.clock import Clock
from reprise_common.logging import get_logger
from reprise_orchestrator.auth import service
from reprise_orchestrator.auth.models import ApiKey

log = get_logger("reprise.orchestrator.auth")


class LocalKeys:
    """Checks a key against the orchestrator's key table (the database call runs off the event loop)."""

    def __init__(self, engine: Engine, clock: Clock) -> None:
        self.engine = engine
        self.clock = clock

    async def verify(self, key: str) -> Principal | None:
        """The principal of a live key, else None."""
        row = await asyncio.to_thread(self._lookup, key_id_of(key), hash_key(key))
        return _principal(row)

    async def answer(self, data: bytes) -> KeyCheckAnswer:
        """Another service's key check: valid with the key's scopes, or not valid (a malformed check included)."""
        try:
            check = KeyCheck.model_validate_json(data)
        except ValidationError:
            log.warning("malformed key check refused", extra={"size": len(data)})
            return KeyCheckAnswer(valid=False)
        principal = _principal(await asyncio.to_thread(self._lookup, check.key_id, check.digest))
        if principal is None:
            return KeyCheckAnswer(valid=False)
        return KeyCheckAnswer(
            valid=True,
            key_id=principal.key_id,
            name=principal.name,
            scopes=[scope for scope in Scope if principal.holds(scope)],
        )

    def _lookup(self, key_id: str | None, digest: str) -> ApiKey | None:
        with Session(self.engine) as session:
            return service.authenticate_digest(session, key_id=key_id, digest=digest, now=self.clock.now())


def _principal(row: ApiKey | None) -> Principal | None:
    return Principal(key_id=row.id, name=row.name, scopes=frozenset(row.scopes)) if row is not None else None
