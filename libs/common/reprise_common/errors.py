"""The one error hierarchy of Reprise; services map these to HTTP errors in one place."""

from __future__ import annotations


class RepriseError(Exception):
    """Base of every error Reprise raises on purpose."""


class ConfigError(RepriseError):
    """A setting is missing or invalid; the message names it and the fix."""


class NotFoundError(RepriseError):
    """The thing asked for does not exist."""


class ConflictError(RepriseError):
    """The request conflicts with the current state (for example a duplicate id)."""


class StaleFenceError(RepriseError):
    """A command carried a fencing token lower than one already seen for the same job."""

    def __init__(self, job_id: str, fence: int, highest: int) -> None:
        super().__init__(f"stale fencing token {fence} for job {job_id}: highest seen is {highest}")
        self.job_id = job_id
        self.fence = fence
        self.highest = highest


class DependencyUnavailableError(RepriseError):
    """A system Reprise depends on and does not run itself (a cluster scheduler's controller) did not answer; the
    request may be repeated once it is back. `dependency` names it for people."""

    dependency = "a dependency"


class BusError(RepriseError):
    """The message bus could not do what was asked (not connected, no responder, timeout)."""


class NotConnectedError(BusError):
    """The client holds no live connection to NATS (before connect(), or while it reconnects)."""


class NoRespondersError(BusError):
    """Nothing listens on a request's subject: the server answered at once that no one will reply."""

    def __init__(self, subject: str) -> None:
        super().__init__(f"no responder on {subject}")
        self.subject = subject


class RequestTimeoutError(BusError):
    """A request was sent but no reply came within its deadline (the responder may still act on it)."""


class BadReplyError(BusError):
    """A reply came but could not be parsed as the expected type."""


class MalformedEventError(RepriseError):
    """A message could not be parsed into a known event schema; it is dead-lettered, never retried."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
