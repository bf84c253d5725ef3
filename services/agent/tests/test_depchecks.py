"""Dependency checks against real directories, real sockets and a real local HTTP server; time from ManualClock."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from reprise_agent.depchecks.checker import CheckResult, DependencyChecker, rendezvous_job, rendezvous_name
from reprise_agent.depchecks.probes import BlockingRunner, DependencyCheckError
from reprise_agent.depchecks.specs import (
    DEPENDENCY_CHECKS,
    DependencyChecks,
    DependencyCheckSpec,
    DiskCheck,
    HttpCheck,
    StorageCheck,
    TcpCheck,
)
from reprise_common.clock import ManualClock
from reprise_common.errors import ConfigError

pytestmark = pytest.mark.timeout(10)


# --- real servers ---------------------------------------------------------------------------------------------
class LocalServer:
    """A real TCP server on a free port; on HTTP it answers /ok with 200, /fail with 500 and never answers /hang."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.port = 0
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            request_line = await reader.readline()
            if not request_line:
                return  # a bare TCP check: connect and close
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass
            path = request_line.split()[1].decode()
            if path == "/hang":
                await asyncio.Event().wait()  # accepted, never answered
            status = {"/ok": "200 OK", "/fail": "500 Internal Server Error"}.get(path, "404 Not Found")
            writer.write(f"HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
        finally:
            writer.close()
            self._writers.discard(writer)

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in list(self._writers):
            writer.close()
        await self.server.wait_closed()


@pytest.fixture
async def server() -> AsyncIterator[LocalServer]:
    srv = LocalServer()
    await srv.start()
    yield srv
    await srv.close()


def closed_port() -> int:
    """A port nothing listens on: bind to get a free one, then close it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def run_one(spec: DependencyCheckSpec) -> CheckResult:
    [result] = await DependencyChecker([spec], clock=ManualClock()).run_once()
    return result


# --- storage --------------------------------------------------------------------------------------------------
async def test_storage_on_a_writable_directory_passes_and_leaves_nothing_behind(tmp_path: Path) -> None:
    result = await run_one(StorageCheck(path=tmp_path))
    assert result.ok, result.detail
    assert (result.name, result.kind) == (f"storage:{tmp_path}", "storage")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("make_path", "reason"),
    [
        (lambda tmp: tmp / "regular-file" / "ckpt", "Not a directory"),
        (lambda tmp: tmp / "never-mounted", "No such file or directory"),
        (lambda tmp: Path("/proc"), "cannot create probe file in /proc"),
    ],
    ids=["under-a-file", "missing", "proc"],
)
async def test_storage_that_cannot_be_written_fails_with_the_step_and_reason(
    tmp_path: Path, make_path: Callable[[Path], Path], reason: str
) -> None:
    # Tests run as root, where chmod does not stop writes: these paths refuse a write even to root.
    (tmp_path / "regular-file").write_text("not a directory")
    path = make_path(tmp_path)
    result = await run_one(StorageCheck(path=path))
    assert not result.ok
    assert result.detail.startswith(f"cannot create probe file in {path}: ")
    assert reason in result.detail


# --- disk -----------------------------------------------------------------------------------------------------
async def test_disk_with_room_passes_and_an_impossible_minimum_fails(tmp_path: Path) -> None:
    ok = await run_one(DiskCheck(path=tmp_path, min_free_bytes=1))
    assert ok.ok, ok.detail
    assert "GiB free" in ok.detail

    too_many_bytes = await run_one(DiskCheck(path=tmp_path, min_free_bytes=10**18))
    assert not too_many_bytes.ok
    assert "below the minimum of 931322574.62 GiB" in too_many_bytes.detail

    everything_free = await run_one(DiskCheck(path=tmp_path, min_free_fraction=1.0))
    assert not everything_free.ok
    assert "below the minimum of 100.0%" in everything_free.detail


async def test_disk_on_a_missing_path_fails(tmp_path: Path) -> None:
    result = await run_one(DiskCheck(path=tmp_path / "gone", min_free_bytes=1))
    assert not result.ok
    assert "cannot stat filesystem" in result.detail


def test_disk_check_needs_a_limit() -> None:
    with pytest.raises(ValidationError, match="min_free_bytes or min_free_fraction"):
        DiskCheck(path=Path("/"))


# --- tcp and http ---------------------------------------------------------------------------------------------
async def test_tcp_to_a_listening_server_passes_and_to_a_closed_port_fails(server: LocalServer) -> None:
    ok = await run_one(TcpCheck(host="127.0.0.1", port=server.port))
    assert ok.ok, ok.detail
    assert ok.name == f"tcp:127.0.0.1:{server.port}"

    port = closed_port()
    refused = await run_one(TcpCheck(host="127.0.0.1", port=port))
    assert not refused.ok
    assert f"cannot connect to 127.0.0.1:{port}" in refused.detail
    assert "refused" in refused.detail.lower()


async def test_http_status_decides(server: LocalServer) -> None:
    ok = await run_one(HttpCheck(url=server.url("/ok")))
    assert ok.ok, ok.detail

    error = await run_one(HttpCheck(url=server.url("/fail")))
    assert not error.ok
    assert error.detail == f"GET {server.url('/fail')} answered 500, expected 200"

    expected_error = await run_one(HttpCheck(url=server.url("/fail"), expect_status=500))
    assert expected_error.ok, expected_error.detail


async def test_http_to_a_closed_port_fails() -> None:
    url = f"http://127.0.0.1:{closed_port()}/health"
    result = await run_one(HttpCheck(url=url))
    assert not result.ok
    assert result.detail == f"GET {url} failed: Connection refused"


async def test_hung_endpoints_time_out_on_their_own_deadlines_concurrently(server: LocalServer, tmp_path: Path) -> None:
    hung = [HttpCheck(name=f"hung-{i}", url=server.url("/hang"), timeout_s=0.4) for i in range(4)]
    healthy: list[DependencyCheckSpec] = [TcpCheck(host="127.0.0.1", port=server.port), StorageCheck(path=tmp_path)]
    checker = DependencyChecker([*hung, *healthy], clock=ManualClock())

    started = time.monotonic()
    results = await checker.run_once()
    elapsed = time.monotonic() - started

    assert 0.35 < elapsed < 1.2  # each hung check waited its own 0.4 s, all at once (in turn: 1.6 s)
    by_name = {r.name: r for r in results}
    for spec in hung:
        assert not by_name[spec.name].ok
        assert by_name[spec.name].detail == f"no answer from {server.url('/hang')} within 0.4 s"
    assert all(by_name[spec.name].ok for spec in healthy)


# --- blocking probes ------------------------------------------------------------------------------------------
async def test_a_stuck_blocking_probe_times_out_and_is_not_started_twice() -> None:
    release = threading.Event()
    calls: list[int] = []

    def stuck_then_fine() -> str:
        calls.append(1)
        release.wait(5)  # a real blocked thread, as in a hung mount
        return "fine"

    runner = BlockingRunner()
    with pytest.raises(TimeoutError):
        await runner.run("storage:/ckpt", stuck_then_fine, timeout_s=0.1)
    with pytest.raises(DependencyCheckError, match="previous probe is still blocked after"):
        await runner.run("storage:/ckpt", stuck_then_fine, timeout_s=0.1)
    assert len(calls) == 1

    release.set()
    await asyncio.sleep(0.05)
    assert await runner.run("storage:/ckpt", stuck_then_fine, timeout_s=1.0) == "fine"
    assert len(calls) == 2


# --- edges ----------------------------------------------------------------------------------------------------
async def test_poll_reports_edges_and_repeats_a_lasting_failure_every_repeat_s(tmp_path: Path) -> None:
    mount = tmp_path / "ckpt"
    mount.mkdir()
    clock = ManualClock()
    checker = DependencyChecker([StorageCheck(name="ckpt", path=mount)], clock=clock, repeat_s=60)

    assert await checker.poll() == []  # healthy from the start: nothing to say

    mount.rmdir()
    mount.write_text("the mount is gone")
    [failed] = await checker.poll()
    assert (failed.name, failed.ok) == ("ckpt", False)
    assert "Not a directory" in failed.detail
    assert checker.failing == {"ckpt"}

    clock.advance(59)
    assert await checker.poll() == []  # still failing, already said so
    clock.advance(1)
    [repeated] = await checker.poll()
    assert not repeated.ok
    clock.advance(30)
    assert await checker.poll() == []

    mount.unlink()
    mount.mkdir()
    [recovered] = await checker.poll()
    assert (recovered.name, recovered.ok) == ("ckpt", True)
    assert checker.failing == frozenset()
    assert await checker.poll() == []

    mount.rmdir()
    [failed_again] = await checker.poll()  # a new failure is reported at once, whatever repeat_s says
    assert not failed_again.ok


async def test_rendezvous_is_checked_only_while_set_and_not_blamed_during_its_grace(server: LocalServer) -> None:
    clock = ManualClock()
    checker = DependencyChecker([], clock=clock, rendezvous_grace_s=30)
    assert await checker.poll_rendezvous() == []

    checker.set_rendezvous("job-1", "127.0.0.1", server.port)
    [ok] = await checker.run_rendezvous()
    assert (ok.name, ok.ok) == ("rendezvous:job-1", True)
    assert await checker.poll_rendezvous() == []

    port = closed_port()
    checker.set_rendezvous("job-1", "127.0.0.1", port)  # relaunched with a new master port not up yet
    [down] = await checker.run_rendezvous()
    assert not down.ok
    assert down.detail == f"cannot connect to 127.0.0.1:{port}: Connection refused"
    assert await checker.poll_rendezvous() == []  # may still be starting

    clock.advance(30)
    [failed] = await checker.poll_rendezvous()
    assert (failed.name, failed.ok) == (rendezvous_name("job-1"), False)
    assert checker.failing == {"rendezvous:job-1"}

    checker.clear_rendezvous("job-1")  # the job stopped: no recovery to announce, nothing left to check
    assert checker.failing == frozenset()
    assert await checker.poll_rendezvous() == []
    assert await checker.run_rendezvous() == []


async def test_static_and_rendezvous_checks_keep_separate_state(tmp_path: Path) -> None:
    clock = ManualClock()
    checker = DependencyChecker([StorageCheck(path=tmp_path / "missing")], clock=clock, rendezvous_grace_s=0)
    checker.set_rendezvous("job-2", "127.0.0.1", closed_port())
    static, rdzv = await asyncio.gather(checker.poll(), checker.poll_rendezvous())
    assert [r.name for r in static] == [f"storage:{tmp_path / 'missing'}"]
    assert [r.name for r in rdzv] == ["rendezvous:job-2"]
    assert {r.name for r in checker.latest()} == checker.failing


# --- configuration --------------------------------------------------------------------------------------------
class _Settings(BaseSettings):
    """The field as AgentSettings declares it."""

    model_config = SettingsConfigDict(env_prefix="REPRISE_", extra="ignore")

    dependency_checks: DependencyChecks = []


def test_reprise_dependency_checks_env_parses_into_the_union(monkeypatch: pytest.MonkeyPatch) -> None:
    checks = [
        {"kind": "storage", "path": "/ckpt", "max_write_latency_s": 5},
        {"kind": "disk", "path": "/", "min_free_fraction": 0.05},
        {"kind": "tcp", "name": "object-store", "host": "s3.internal", "port": 443},
        {"kind": "http", "url": "http://registry.internal:8080/health", "expect_status": 204},
    ]
    monkeypatch.setenv("REPRISE_DEPENDENCY_CHECKS", json.dumps(checks))
    parsed = _Settings().dependency_checks
    assert [type(spec) for spec in parsed] == [StorageCheck, DiskCheck, TcpCheck, HttpCheck]
    assert [spec.name for spec in parsed] == [
        "storage:/ckpt",
        "disk:/",
        "object-store",
        "http:http://registry.internal:8080/health",
    ]


def test_an_unknown_kind_is_refused_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REPRISE_DEPENDENCY_CHECKS", json.dumps([{"kind": "nfs", "path": "/ckpt"}]))
    with pytest.raises(ValidationError) as caught:
        _Settings()
    message = str(caught.value)
    assert "dependency_checks.0" in message
    assert "'kind'" in message
    assert "'nfs'" in message
    assert "'storage', 'disk', 'tcp', 'http'" in message


@pytest.mark.parametrize(
    ("checks", "complaint"),
    [
        ([{"kind": "tcp", "host": "h", "port": 1, "timeout": 3}], "Extra inputs are not permitted"),
        ([{"kind": "tcp", "host": "h", "port": 70000}], "less than or equal to 65535"),
        ([{"kind": "http", "url": "ftp://h/x"}], "URL scheme should be 'http' or 'https'"),
        ([{"kind": "tcp", "host": "h", "port": 1}, {"kind": "tcp", "host": "h", "port": 1}], "two dependency"),
    ],
    ids=["misspelt-field", "bad-port", "bad-scheme", "duplicate-name"],
)
def test_bad_specs_are_refused_with_a_reason(checks: list[dict[str, object]], complaint: str) -> None:
    with pytest.raises(ValidationError, match=complaint):
        DEPENDENCY_CHECKS.validate_python(checks)


def test_the_checker_refuses_duplicate_names() -> None:
    spec = TcpCheck(host="h", port=1)
    with pytest.raises(ConfigError, match="tcp:h:1"):
        DependencyChecker([spec, spec], clock=ManualClock())


@pytest.mark.parametrize(("name", "job"), [("rendezvous:job-1", "job-1"), ("storage", None), ("tcp:rendezvous", None)])
def test_a_dependency_name_tells_the_job_of_a_rendezvous_master(name: str, job: str | None) -> None:
    assert rendezvous_job(name) == job
    if job is not None:
        assert rendezvous_name(job) == name
