"""HMAC-SHA256 signatures of webhook bodies, and the verify function a receiver can copy.

Every webhook request carries ``X-Reprise-Timestamp`` (Unix seconds) and ``X-Reprise-Signature: v1=<hex>``, where
the hex is HMAC-SHA256 with the shared secret over ``"<timestamp>.<raw body>"``. Signing the timestamp with the body
lets a receiver refuse replays older than its tolerance. During a secret rotation the header may hold several
signatures separated by commas; one valid signature is enough.
"""

from __future__ import annotations

import hashlib
import hmac
import time

TIMESTAMP_HEADER = "X-Reprise-Timestamp"
SIGNATURE_HEADER = "X-Reprise-Signature"
SCHEME = "v1"
MIN_SECRET_LENGTH = 16
_PLACEHOLDERS = {"changeme", "change-me", "secret", "password", "example", "todo", "xxx"}


def sign(secret: bytes, timestamp: int, body: bytes) -> str:
    """The signature header value for one body: ``v1=<hex hmac of "<timestamp>.<body>">``."""
    digest = hmac.new(secret, str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"{SCHEME}={digest}"


def signature_headers(secret: bytes, body: bytes, *, timestamp: int) -> dict[str, str]:
    """The two headers a signed webhook request carries."""
    return {TIMESTAMP_HEADER: str(timestamp), SIGNATURE_HEADER: sign(secret, timestamp, body)}


def verify(
    secret: bytes, body: bytes, timestamp: str, signature: str, *, tolerance_s: int = 300, now: float | None = None
) -> bool:
    """True when one v1 signature matches the raw body and the timestamp is within tolerance_s of now.

    Receivers: copy this function (it needs only hashlib, hmac and time), pass the raw request body (before any
    JSON parsing) and the two header values, and answer 401 when it returns False.
    """
    try:
        sent = int(timestamp)
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - sent) > tolerance_s:
        return False
    expected = hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    for part in signature.split(","):
        scheme, _, value = part.strip().partition("=")
        if scheme == SCHEME and hmac.compare_digest(value, expected):
            return True
    return False


def check_secret(what: str, value: str) -> str:
    """Return a signing secret, or raise ValueError naming `what` when it is short or a placeholder."""
    if len(value) < MIN_SECRET_LENGTH or value.strip().lower() in _PLACEHOLDERS or value.startswith("<"):
        raise ValueError(f"{what} must be a real secret of at least {MIN_SECRET_LENGTH} characters")
    return value
