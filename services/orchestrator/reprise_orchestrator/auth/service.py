"""Data access for API keys and audit records: keyword-only functions.

Keys are `rpk_<id>_<secret>` with a 256-bit random secret. Only the SHA-256 of the whole key is stored: a fast hash
is enough because the secret is random and long, so there is nothing to guess (a slow password hash protects
low-entropy human secrets, and would cost every request). Digests are compared with hmac.compare_digest.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, or_, select

from reprise_common.auth import KEY_PREFIX, Scope, granted, hash_key, key_id_of
from reprise_common.errors import NotFoundError
from reprise_common.events import new_id
from reprise_orchestrator.auth.models import ApiKey, AuditRecord

BOOTSTRAP_ID = "bootstrap"
BOOTSTRAP_READ_ID = "bootstrap-read"
# Keys whose value the operator chose (any shape): a key that names no id is compared against these rows.
BOOTSTRAP_IDS = (BOOTSTRAP_ID, BOOTSTRAP_READ_ID)
SECRET_BYTES = 32
# last_used_at is a hint for operators, not a log: rewrite it at most this often, not on every request.
LAST_USED_RESOLUTION = timedelta(seconds=60)
# Compared against when no key row matches, so an unknown id costs the same work as a wrong secret.
_NO_KEY_DIGEST = hashlib.sha256(b"no such key").hexdigest()


def create(session: Session, *, name: str, scopes: list[Scope], now: datetime) -> tuple[ApiKey, str]:
    """Record a new key; returns the row and the key itself, which is never stored and cannot be shown again."""
    key_id = new_id()[:16]
    key = f"{KEY_PREFIX}_{key_id}_{secrets.token_urlsafe(SECRET_BYTES)}"
    row = ApiKey(id=key_id, name=name, hash=hash_key(key), scopes=granted(scopes), created_at=now)
    session.add(row)
    session.commit()
    session.refresh(row)
    return row, key


def get_all(session: Session) -> Sequence[ApiKey]:
    """Every key, revoked ones included, newest first."""
    return session.exec(select(ApiKey).order_by(col(ApiKey.created_at).desc())).all()


def revoke(session: Session, *, key_id: str, now: datetime) -> ApiKey:
    """Revoke a key (idempotent: the first revocation time stays); NotFoundError if unknown."""
    row = session.get(ApiKey, key_id)
    if row is None:
        raise NotFoundError(f"API key {key_id} not found")
    if row.revoked_at is None:
        row.revoked_at = now
        session.add(row)
        session.commit()
        session.refresh(row)
    return row


def authenticate(session: Session, *, key: str, now: datetime) -> ApiKey | None:
    """The live key row that `key` is, or None (unknown, wrong secret or revoked)."""
    return authenticate_digest(session, key_id=key_id_of(key), digest=hash_key(key), now=now)


def authenticate_digest(session: Session, *, key_id: str | None, digest: str, now: datetime) -> ApiKey | None:
    """The live key row whose SHA-256 is `digest` (its id given when the key names one), or None."""
    candidates = [key_id] if key_id is not None else []
    rows = [row for row in (session.get(ApiKey, name) for name in [*candidates, *BOOTSTRAP_IDS]) if row is not None]
    match = None
    for row in rows:  # every candidate compared, in constant time: no answer says which part was wrong
        if hmac.compare_digest(digest, row.hash):
            match = row
    if match is None:
        hmac.compare_digest(digest, _NO_KEY_DIGEST)
    if match is None or match.revoked_at is not None:
        return None
    if match.last_used_at is None or now - match.last_used_at >= LAST_USED_RESOLUTION:
        match.last_used_at = now
        session.add(match)
        session.commit()
        session.refresh(match)
    return match


def ensure_bootstrap(
    session: Session, *, key: str, now: datetime, key_id: str = BOOTSTRAP_ID, scope: Scope = Scope.ADMIN
) -> ApiKey:
    """Make `key` the key `key_id` (bootstrap: admin; bootstrap-read: read): created once, replaced when the value
    changes, never un-revoked."""
    digest = hash_key(key)
    row = session.get(ApiKey, key_id)
    if row is not None and hmac.compare_digest(row.hash, digest):
        return row  # same value as before: nothing to do, and a revoked bootstrap key stays revoked
    if row is None:
        row = ApiKey(id=key_id, name=key_id, hash=digest, scopes=granted([scope]), created_at=now)
    else:  # the operator set a new value: the old one stops working, the new one works
        row.hash, row.revoked_at, row.last_used_at, row.created_at = digest, None, None, now
    session.add(row)
    try:
        session.commit()
    except IntegrityError:  # another replica inserted it at the same moment, from the same setting
        session.rollback()
        return ensure_bootstrap(session, key=key, now=now, key_id=key_id, scope=scope)
    session.refresh(row)
    return row


def count_live_admins(session: Session) -> int:
    """How many unrevoked keys hold the admin scope."""
    rows = session.exec(select(ApiKey).where(col(ApiKey.revoked_at).is_(None))).all()
    return sum(1 for row in rows if Scope.ADMIN.value in row.scopes)


def record(session: Session, *, entry: AuditRecord) -> None:
    """Append one audit record."""
    session.add(entry)
    session.commit()


def get_audit(
    session: Session,
    *,
    actor: str | None = None,
    job_id: str | None = None,
    since: datetime | None = None,
    limit: int = 100,
) -> Sequence[AuditRecord]:
    """Audit records matching every given filter (actor: a key's name or id), newest first."""
    query = select(AuditRecord).order_by(col(AuditRecord.at).desc(), col(AuditRecord.id).desc()).limit(limit)
    if actor is not None:
        query = query.where(or_(col(AuditRecord.actor) == actor, col(AuditRecord.key_id) == actor))
    if job_id is not None:
        query = query.where(AuditRecord.job_id == job_id)
    if since is not None:
        query = query.where(col(AuditRecord.at) >= since)
    return session.exec(query).all()
