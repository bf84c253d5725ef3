"""One request to one destination over HTTP: explicit timeouts, the answer classified, the URL never leaked.

The webhook URL is the secret (a Slack incoming webhook needs no other credential), so nothing that leaves this
module carries it: errors are reduced to their type and a scrubbed message, and callers name the destination.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime
from urllib.parse import quote, urlsplit

import httpx

from reprise_common.clock import Clock
from reprise_notifier.deliveries.models import SendResult
from reprise_notifier.routing import Destination

MAX_DETAIL = 300
# 408 (request timeout) and 425 (too early) say "try again"; 429 says "later"; any other 4xx will never succeed.
_RETRYABLE_4XX = {408, 425}


@dataclass(frozen=True)
class Answer:
    """A destination's answer to one request, classified: retryable or not, with a reason that names no URL."""

    result: SendResult
    status: int | None = None
    detail: str = ""
    retry_after_s: float | None = None


def classify(status: int, headers: Mapping[str, str], body: str, *, now: datetime) -> Answer:
    """What an HTTP answer means for the delivery: sent, rate limited (with Retry-After), retry later, or never."""
    detail = f"http {status}" + (f": {body.strip()[:MAX_DETAIL]}" if body.strip() else "")
    if 200 <= status < 300:
        return Answer(SendResult.SENT, status)
    if status == 429:
        return Answer(SendResult.RATE_LIMITED, status, detail, parse_retry_after(headers.get("retry-after"), now=now))
    if status >= 500 or status in _RETRYABLE_4XX:
        return Answer(SendResult.RETRYABLE, status, detail)
    if 300 <= status < 400:
        return Answer(SendResult.REJECTED, status, f"http {status}: redirects are not followed")
    return Answer(SendResult.REJECTED, status, detail)


def parse_retry_after(value: str | None, *, now: datetime) -> float | None:
    """Seconds to wait from a Retry-After header (delta seconds or an HTTP date); None when absent or unreadable."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, (when - now).total_seconds())


def scrub(text: str, destination: Destination) -> str:
    """Text with every form of the destination's URL (whole, without scheme, its path) replaced by its name."""
    url = destination.url.get_secret_value()
    parts = urlsplit(url)
    secrets = {url, url.split("://", 1)[-1], quote(url, safe=""), quote(url)}
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    if len(parts.path.strip("/")) >= 4:  # a Slack webhook's secret is its path: /services/T…/B…/X…
        secrets |= {path, parts.path, quote(parts.path, safe="")}
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, f"<{destination.name}>")
    return text


class Transport:
    """Posts message bodies with one pooled HTTP client; never raises for a network problem."""

    def __init__(self, *, timeout_s: float, clock: Clock, client: httpx.AsyncClient | None = None) -> None:
        self.clock = clock
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s), follow_redirects=False, headers={"User-Agent": "reprise-notifier/0.1"}
        )

    async def post(self, destination: Destination, body: bytes, headers: Mapping[str, str]) -> Answer:
        """POST one body; the answer (or the failure to get one) classified, its detail scrubbed of the URL."""
        try:
            response = await self._client.post(
                destination.url.get_secret_value(),
                content=body,
                headers={"Content-Type": "application/json; charset=utf-8", **headers},
            )
        except httpx.TimeoutException as exc:
            return Answer(SendResult.RETRYABLE, None, scrub(f"timeout ({type(exc).__name__})", destination))
        except httpx.HTTPError as exc:  # connection refused, reset, DNS, protocol errors: all worth another try
            return Answer(SendResult.RETRYABLE, None, scrub(f"{type(exc).__name__}: {exc}", destination)[:MAX_DETAIL])
        now = self.clock.now()
        answer = classify(response.status_code, response.headers, response.text[:MAX_DETAIL], now=now)
        return Answer(answer.result, answer.status, scrub(answer.detail, destination), answer.retry_after_s)

    async def aclose(self) -> None:
        """Close the pooled connections."""
        await self._client.aclose()
