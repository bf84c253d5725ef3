"""How each kind of dependency is checked: blocking probes run in daemon threads, async probes bounded by the caller.

Every probe returns what it saw or raises DependencyCheckError with the detail an operator sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from uuid import uuid4

import httpx

from reprise_agent.depchecks.specs import DiskCheck, DockerCheck, HttpCheck
from reprise_common.errors import RepriseError

T = TypeVar("T")

PROBE_BYTES = 4096
GIB = 1024**3


class DependencyCheckError(RepriseError):
    """A dependency check failed; the message is the detail an operator sees."""


def _reason(exc: OSError) -> str:
    """The OS's words for an error (asyncio's refusals carry only "Connect call failed")."""
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve: {exc.strerror}"
    if exc.errno is not None and exc.errno > 0:
        return os.strerror(exc.errno)
    return str(exc)


def _root_reason(exc: BaseException) -> str:
    """The innermost OS error's words behind a wrapped error (httpx says only "All connection attempts failed")."""
    reason = str(exc) or type(exc).__name__
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, OSError) and (isinstance(cause, socket.gaierror) or (cause.errno or 0) > 0):
            reason = _reason(cause)
        cause = cause.__cause__ or cause.__context__
    return reason


def probe_storage(path: Path) -> str:
    """Write, fsync, read back and delete a uniquely named probe file under ``path`` (blocking)."""
    probe = path / f".reprise-probe-{os.getpid()}-{uuid4().hex}"
    payload = os.urandom(PROBE_BYTES)
    step = "create"
    created = False
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        created = True
        try:
            step = "write"
            os.write(fd, payload)
            step = "fsync"
            os.fsync(fd)
        finally:
            os.close(fd)
        step = "read"
        with probe.open("rb") as handle:
            if handle.read() != payload:
                raise DependencyCheckError(f"probe file in {path} read back different bytes than were written")
        step = "delete"
        probe.unlink()
        created = False
    except OSError as exc:
        raise DependencyCheckError(f"cannot {step} probe file in {path}: {_reason(exc)}") from exc
    finally:
        if created:
            with contextlib.suppress(OSError):
                probe.unlink()
    return f"wrote, synced, read and deleted {PROBE_BYTES} B in {path}"


def probe_disk(spec: DiskCheck) -> str:
    """Compare the free space of ``spec.path``'s filesystem with the limits (blocking)."""
    try:
        stats = os.statvfs(spec.path)
    except OSError as exc:
        raise DependencyCheckError(f"cannot stat filesystem of {spec.path}: {_reason(exc)}") from exc
    free = stats.f_bavail * stats.f_frsize
    total = stats.f_blocks * stats.f_frsize
    fraction = free / total if total else 0.0
    seen = f"{free / GIB:.2f} GiB free ({fraction:.1%}) on {spec.path}"
    if spec.min_free_bytes is not None and free < spec.min_free_bytes:
        raise DependencyCheckError(f"{seen}, below the minimum of {spec.min_free_bytes / GIB:.2f} GiB")
    if spec.min_free_fraction is not None and fraction < spec.min_free_fraction:
        raise DependencyCheckError(f"{seen}, below the minimum of {spec.min_free_fraction:.1%}")
    return seen


async def probe_tcp(host: str, port: int) -> str:
    """Open and close a TCP connection (the caller bounds the time)."""
    try:
        _, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        raise DependencyCheckError(f"cannot connect to {host}:{port}: {_reason(exc)}") from exc
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return f"connected to {host}:{port}"


async def probe_http(spec: HttpCheck) -> str:
    """GET the URL once on a fresh connection and compare the status (the caller bounds the total time)."""
    url = str(spec.url)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(spec.timeout_s), follow_redirects=False) as client:
            response = await client.get(url)
    except httpx.TimeoutException as exc:
        raise DependencyCheckError(f"no answer from {url} within {spec.timeout_s:g} s") from exc
    except httpx.HTTPError as exc:
        raise DependencyCheckError(f"GET {url} failed: {_root_reason(exc)}") from exc
    if response.status_code != spec.expect_status:
        raise DependencyCheckError(f"GET {url} answered {response.status_code}, expected {spec.expect_status}")
    return f"GET {url} answered {response.status_code}"


async def probe_docker(spec: DockerCheck) -> str:
    """Ping the Docker daemon (GET /_ping answers OK) over its Unix socket or TCP (the caller bounds the time)."""
    scheme, _, where = spec.url.partition("://")
    transport = httpx.AsyncHTTPTransport(uds=where) if scheme == "unix" else None
    base = "http://docker" if scheme == "unix" else f"http://{where}"
    try:
        async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(spec.timeout_s)) as client:
            response = await client.get(f"{base}/_ping")
    except httpx.TimeoutException as exc:
        raise DependencyCheckError(f"the Docker daemon at {spec.url} gave no answer in {spec.timeout_s:g} s") from exc
    except httpx.HTTPError as exc:
        raise DependencyCheckError(f"the Docker daemon at {spec.url} is unreachable: {_root_reason(exc)}") from exc
    if response.status_code != 200 or response.text.strip() != "OK":
        raise DependencyCheckError(f"the Docker daemon at {spec.url} answered its ping {response.status_code}")
    return f"the Docker daemon at {spec.url} answered its ping"


class BlockingRunner:
    """Runs blocking probes in daemon threads, at most one per check at a time.

    A thread stuck in a hung NFS/Lustre call cannot be cancelled. Daemon threads do not hold up the agent's exit
    (the default executor would), and refusing a second probe while the first is stuck keeps one dead mount from
    leaking a thread every interval.
    """

    def __init__(self) -> None:
        self._busy: dict[str, tuple[asyncio.Future[Any], float]] = {}  # key -> (outcome, start)

    async def run(self, key: str, fn: Callable[[], T], *, timeout_s: float) -> T:
        """``fn()`` in a thread; TimeoutError after ``timeout_s``, DependencyCheckError if still stuck from before."""
        loop = asyncio.get_running_loop()
        busy = self._busy.get(key)
        if busy is not None and not busy[0].done():
            raise DependencyCheckError(f"the previous probe is still blocked after {loop.time() - busy[1]:.1f} s")
        future: asyncio.Future[T] = loop.create_future()
        # An abandoned probe that fails late must not log "exception was never retrieved".
        future.add_done_callback(lambda done: done.cancelled() or done.exception())

        def target() -> None:
            try:
                settle = functools.partial(_resolve, future, fn())
            except Exception as exc:  # handed to the awaiting task, which decides
                settle = functools.partial(_fail, future, exc)
            with contextlib.suppress(RuntimeError):  # the loop closed while we were stuck: nobody is waiting
                loop.call_soon_threadsafe(settle)

        self._busy[key] = (future, loop.time())
        threading.Thread(target=target, name=f"depcheck {key}", daemon=True).start()
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)


def _resolve(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
