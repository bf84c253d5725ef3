"""The audit trail: an ASGI middleware that records every mutating call, allowed or refused, before it is answered.

It sees only the method, the path, the matched path parameters, the caller's key (set by the auth dependency), the
status and the client address: never a body, a header or a query string, which may hold secrets.
"""

from __future__ import annotations

import asyncio

from sqlalchemy.engine import Engine
from sqlmodel import Session
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from reprise_common.auth import ANONYMOUS, Principal
from reprise_common.clock import Clock
from reprise_common.logging import get_logger
from reprise_orchestrator.auth import service
from reprise_orchestrator.auth.models import AuditRecord

log = get_logger("reprise.orchestrator.audit")
MUTATING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def audit_entry(scope: Scope, *, status: int, clock: Clock) -> AuditRecord:
    """The record of one call, from its ASGI scope (after routing and authentication filled it in)."""
    principal: Principal | None = scope.get("state", {}).get("principal")
    client = scope.get("client")
    job_id = scope.get("path_params", {}).get("job_id")
    return AuditRecord(
        at=clock.now(),
        key_id=principal.key_id if principal is not None else None,
        actor=principal.name if principal is not None else ANONYMOUS,
        method=scope["method"],
        path=scope["path"],
        job_id=str(job_id) if job_id is not None else None,
        status=status,
        client=client[0] if client else None,
    )


class AuditMiddleware:
    """Writes one audit record per POST/PUT/PATCH/DELETE, including 401, 403 and a handler that raised (500)."""

    def __init__(self, app: ASGIApp, *, engine: Engine, clock: Clock) -> None:
        self.app = app
        self.engine = engine
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the call through; record it when its answer starts, or when it raised before answering."""
        if scope["type"] != "http" or scope["method"] not in MUTATING_METHODS:
            await self.app(scope, receive, send)
            return
        recorded = False

        async def send_after_recording(message: Message) -> None:
            nonlocal recorded
            if message["type"] == "http.response.start" and not recorded:
                recorded = True  # written before the answer leaves, so a caller that saw it can find the record
                await self._write(audit_entry(scope, status=message["status"], clock=self.clock))
            await send(message)

        try:
            await self.app(scope, receive, send_after_recording)
        except Exception:
            if not recorded:  # the server answers 500 for an exception nothing handled
                recorded = True
                await self._write(audit_entry(scope, status=500, clock=self.clock))
            raise

    async def _write(self, entry: AuditRecord) -> None:
        try:
            await asyncio.to_thread(self._insert, entry)
        except Exception:  # a failed audit write must not turn the caller's answer into an error; it is logged
            log.exception("audit record not written", extra={"method": entry.method, "path": entry.path})

    def _insert(self, entry: AuditRecord) -> None:
        with Session(self.engine) as session:
            service.record(session, entry=entry)
