"""Dependency checks: storage, disk, TCP and HTTP endpoints, and each running job's rendezvous master.

A node can be perfectly healthy while the things training needs are not: a checkpoint mount that hangs, a full
disk, an unreachable object store. Each check runs with its own deadline so one hung dependency never stalls the
others, and ``poll`` reports edges (ok→failed, failed→ok) rather than levels so a broken mount does not flood the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, assert_never
from uuid import uuid4

import httpx
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, HttpUrl, TypeAdapter, model_validator

from reprise_common.clock import Clock
from reprise_common.errors import ConfigError, RepriseError

T = TypeVar("T")

PROBE_BYTES = 4096
GIB = 1024**3


# --- specs ----------------------------------------------------------------------------------------------------
class _CheckSpec(BaseModel):
    """Fields every check shares; an empty ``name`` is derived from what is checked, e.g. ``storage:/ckpt``."""

    # Operators write these by hand in REPRISE_DEPENDENCY_CHECKS: refuse a misspelt field instead of ignoring it.
    model_config = ConfigDict(extra="forbid")
    _target: ClassVar[str]  # what is checked, formatted from the fields
    _deadline_field: ClassVar[str] = "timeout_s"

    kind: str
    name: str = Field(default="", max_length=256, description="dependency name in events; derived when empty")

    @model_validator(mode="after")
    def _derive_name(self) -> _CheckSpec:
        if not self.name:
            self.name = f"{self.kind}:{self.target()}"
        return self

    def target(self) -> str:
        """What is checked: a path, ``host:port`` or a URL."""
        return self._target.format_map(self.__dict__)

    def deadline_s(self) -> float:
        """How long one whole run of this check may take before it counts as failed."""
        return float(getattr(self, self._deadline_field))


class StorageCheck(_CheckSpec):
    """The path is writable and responsive: write, fsync, read back and delete a small probe file."""

    _target = "{path}"
    _deadline_field = "max_write_latency_s"

    kind: Literal["storage"] = "storage"
    path: Path
    max_write_latency_s: float = Field(default=2.0, gt=0)


class DiskCheck(_CheckSpec):
    """The filesystem holding ``path`` has at least ``min_free_bytes`` and/or ``min_free_fraction`` free."""

    _target = "{path}"

    kind: Literal["disk"] = "disk"
    path: Path
    min_free_bytes: int | None = Field(default=None, ge=0)
    min_free_fraction: float | None = Field(default=None, gt=0, le=1)
    timeout_s: float = Field(default=2.0, gt=0, description="statvfs on a hung network mount blocks too")

    @model_validator(mode="after")
    def _some_limit(self) -> DiskCheck:
        if self.min_free_bytes is None and self.min_free_fraction is None:
            raise ValueError("a disk check needs min_free_bytes or min_free_fraction (or both)")
        return self


class TcpCheck(_CheckSpec):
    """A TCP connection to ``host:port`` opens within ``timeout_s``."""

    _target = "{host}:{port}"

    kind: Literal["tcp"] = "tcp"
    host: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    timeout_s: float = Field(default=2.0, gt=0)


class HttpCheck(_CheckSpec):
    """A GET on ``url`` answers ``expect_status`` within ``timeout_s`` in total (redirects are not followed)."""

    _target = "{url}"

    kind: Literal["http"] = "http"
    url: HttpUrl
    timeout_s: float = Field(default=2.0, gt=0)
    expect_status: int = Field(default=200, ge=100, le=599)


DependencyCheckSpec = Annotated[StorageCheck | DiskCheck | TcpCheck | HttpCheck, Field(discriminator="kind")]


def _unique_names(specs: list[DependencyCheckSpec]) -> list[DependencyCheckSpec]:
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"two dependency checks are named {spec.name!r}: give one of them another name")
        seen.add(spec.name)
    return specs


# The settings field type: a JSON list in REPRISE_DEPENDENCY_CHECKS, each item picked by its "kind".
DependencyChecks = Annotated[list[DependencyCheckSpec], AfterValidator(_unique_names)]
DEPENDENCY_CHECKS = TypeAdapter(DependencyChecks)


# --- results --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CheckResult:
    """One run of one check; ``detail`` says what was seen, for the operator."""

    name: str
    kind: str
    ok: bool
    detail: str
    duration_s: float


class DependencyCheckError(RepriseError):
    """A dependency check failed; the message is the detail an operator sees."""


# --- probes ---------------------------------------------------------------------------------------------------
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


# --- the checker ----------------------------------------------------------------------------------------------
class DependencyChecker:
    """Runs the configured checks concurrently and turns their results into edges worth publishing."""

    def __init__(
        self,
        specs: Sequence[DependencyCheckSpec],
        *,
        clock: Clock,
        repeat_s: float = 60.0,
        rendezvous_timeout_s: float = 2.0,
        rendezvous_grace_s: float = 30.0,
    ) -> None:
        try:
            self.specs: list[DependencyCheckSpec] = _unique_names(list(specs))
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        self.clock = clock
        self.repeat_s = repeat_s
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.rendezvous_grace_s = rendezvous_grace_s
        self._runner = BlockingRunner()
        self._rendezvous: dict[str, tuple[TcpCheck, float]] = {}  # job id -> (check, monotonic time it was set)
        self._failing: dict[str, float] = {}  # name -> monotonic time it was last reported
        self._latest: dict[str, CheckResult] = {}

    @property
    def failing(self) -> frozenset[str]:
        """Names of the checks currently reported as failing."""
        return frozenset(self._failing)

    def latest(self) -> list[CheckResult]:
        """The most recent result of every check run so far (for a health page or the node report)."""
        return list(self._latest.values())

    # --- static checks ----------------------------------------------------------------------------------------
    async def run_once(self) -> list[CheckResult]:
        """Run every configured check concurrently, each bounded by its own deadline."""
        results = await asyncio.gather(*(self._check(spec) for spec in self.specs))
        self._latest.update((result.name, result) for result in results)
        return list(results)

    async def poll(self) -> list[CheckResult]:
        """Run the checks; return new failures, failures due for a repeat, and recoveries (``ok=True``)."""
        return self._edges(await self.run_once())

    async def _check(self, spec: DependencyCheckSpec) -> CheckResult:
        started = self.clock.monotonic()
        deadline = spec.deadline_s()
        try:
            ok, detail = True, await self._probe(spec, deadline)
        except TimeoutError:
            ok, detail = False, f"no answer from {spec.target()} within {deadline:g} s"
        except DependencyCheckError as exc:
            ok, detail = False, str(exc)
        return CheckResult(spec.name, spec.kind, ok, detail, max(0.0, self.clock.monotonic() - started))

    async def _probe(self, spec: DependencyCheckSpec, deadline: float) -> str:
        if isinstance(spec, StorageCheck):
            path = spec.path
            return await self._runner.run(spec.name, lambda: probe_storage(path), timeout_s=deadline)
        if isinstance(spec, DiskCheck):
            return await self._runner.run(spec.name, lambda: probe_disk(spec), timeout_s=deadline)
        if isinstance(spec, TcpCheck):
            return await asyncio.wait_for(probe_tcp(spec.host, spec.port), deadline)
        if isinstance(spec, HttpCheck):
            return await asyncio.wait_for(probe_http(spec), deadline)
        assert_never(spec)

    # --- rendezvous masters -----------------------------------------------------------------------------------
    def watched_rendezvous(self) -> list[str]:
        """The jobs whose rendezvous master is being watched."""
        return sorted(self._rendezvous)

    def set_rendezvous(self, job_id: str, host: str, port: int) -> None:
        """Watch the rendezvous master of a job running here (a relaunch replaces it and restarts the grace)."""
        self._forget(rendezvous_name(job_id))
        check = TcpCheck(name=rendezvous_name(job_id), host=host, port=port, timeout_s=self.rendezvous_timeout_s)
        self._rendezvous[job_id] = (check, self.clock.monotonic())

    def clear_rendezvous(self, job_id: str) -> None:
        """Stop watching a job's rendezvous master (the job stopped or moved); its failure state is dropped."""
        self._rendezvous.pop(job_id, None)
        self._forget(rendezvous_name(job_id))

    async def run_rendezvous(self) -> list[CheckResult]:
        """TCP-check every watched rendezvous master concurrently."""
        results = await asyncio.gather(*(self._check(check) for check, _ in self._rendezvous.values()))
        self._latest.update((result.name, result) for result in results)
        return list(results)

    async def poll_rendezvous(self) -> list[CheckResult]:
        """Edges of the rendezvous checks; a master younger than the grace may still be starting, so is not blamed."""
        now = self.clock.monotonic()
        starting = {check.name for check, since in self._rendezvous.values() if now - since < self.rendezvous_grace_s}
        return self._edges(r for r in await self.run_rendezvous() if r.ok or r.name not in starting)

    # --- edges ------------------------------------------------------------------------------------------------
    def _edges(self, results: Iterable[CheckResult]) -> list[CheckResult]:
        now = self.clock.monotonic()
        edges: list[CheckResult] = []
        for result in results:
            last_reported = self._failing.get(result.name)
            if result.ok:
                if last_reported is not None:
                    del self._failing[result.name]
                    edges.append(result)
            elif last_reported is None or now - last_reported >= self.repeat_s:
                self._failing[result.name] = now
                edges.append(result)
        return edges

    def _forget(self, name: str) -> None:
        self._failing.pop(name, None)
        self._latest.pop(name, None)


_RENDEZVOUS = "rendezvous:"


def rendezvous_name(job_id: str) -> str:
    """The dependency name of a job's rendezvous master, as it appears in events."""
    return f"{_RENDEZVOUS}{job_id}"


def rendezvous_job(name: str) -> str | None:
    """The job whose rendezvous master a dependency name stands for; None for any other dependency."""
    return name.removeprefix(_RENDEZVOUS) if name.startswith(_RENDEZVOUS) else None
