"""Chaos: a burst of checkpoint reports over JetStream while NATS (one server, or one of a 3-server cluster), or the
registry consuming them, is killed -9.

Real parts only: nats-server with its file store, the checkpoint registry as its own process on SQLite, the shared
bus client publishing like an agent: a refused publish is tried again with the same message id, as the agent's
outbox does. Every report must end up acknowledged (within 30 s of retries) and registered exactly once (one
checkpoint per job and step, one rank report each), whatever was killed in the middle; nothing else may appear. The
burst has REPRISE_CHAOS_EVENTS reports (1,000 in `make test`, 10,000 in `make chaos`).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from nats.errors import Error as NatsError

from reprise_cli.servers import ManagedProcess, NatsCluster, NatsServer, free_port, wait_until
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.errors import BusError
from reprise_common.events import CheckpointSaved, FileDigest

pytestmark = [pytest.mark.chaos, pytest.mark.stack, pytest.mark.timeout(600)]
EVENTS = int(os.environ.get("REPRISE_CHAOS_EVENTS", "1000"))
JOBS = 10
RETRY_S, RETRY_FOR_S = 0.5, 30.0  # a refused publish is tried again (the agent's outbox waits 0.5 s too)
KEY = secrets.token_urlsafe(32)
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Registry:
    """The registry as a process, restartable with the same database and port."""

    process: ManagedProcess
    url: str

    def start(self) -> None:
        self.process.start()

        def ready() -> bool:
            try:
                return httpx.get(self.url + "/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(ready, timeout_s=60), self.process.log_tail()

    def registered(self) -> dict[tuple[str, int], int]:
        """Every checkpoint of the burst's jobs: (job, step) -> how many rows."""
        seen: dict[tuple[str, int], int] = {}
        for job in range(JOBS):
            answer = httpx.get(
                f"{self.url}/v1/jobs/chaos-{job}/checkpoints", params={"limit": 1000}, headers=AUTH, timeout=30
            )
            answer.raise_for_status()
            for row in answer.json()["data"]:
                key = (row["job_id"], int(row["step"]))
                seen[key] = seen.get(key, 0) + 1
        return seen


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(
        port=free_port(), monitor_port=free_port(), store_dir=tmp_path / "nats-store", log_path=tmp_path / "nats.log"
    )
    server.start()
    yield server
    server.stop()


def start_registry(nats_url: str, tmp_path: Path, *, replicas: int = 1) -> Registry:
    """The registry as its own process on SQLite, consuming agents' events from `nats_url`."""
    port = free_port()
    env = {
        "REPRISE_HTTP_PORT": str(port),
        "REPRISE_DATABASE_URL": f"sqlite:///{tmp_path / 'registry.db'}",
        "REPRISE_STATE_DIR": str(tmp_path / "state"),
        "REPRISE_NATS_URL": nats_url,
        "REPRISE_NATS_STREAM_REPLICAS": str(replicas),
        "REPRISE_ADMIN_API_KEY": KEY,
        "REPRISE_CHECKPOINT_ROOTS": f'["{tmp_path / "ckpt"}"]',
    }
    binary = str(Path(sys.executable).parent / "reprise-registry")
    process = ManagedProcess("registry", [binary], tmp_path / "registry.log", env)
    registry = Registry(process, f"http://127.0.0.1:{port}")
    registry.start()
    return registry


@pytest.fixture
def registry(nats: NatsServer, tmp_path: Path) -> Iterator[Registry]:
    registry = start_registry(nats.url, tmp_path)
    yield registry
    registry.process.stop()


@dataclass
class Burst:
    """What was published, and which publishes JetStream acknowledged."""

    acked: set[tuple[str, int]] = field(default_factory=set)
    refused: int = 0  # reports never acknowledged, after every retry
    retried: int = 0  # publishes refused and tried again (the server down or moving), as an agent's outbox does


def report(index: int, root: Path) -> CheckpointSaved:
    job, step = f"chaos-{index % JOBS}", index // JOBS
    path = root / job / f"step-{step:08d}"
    digest = FileDigest(path="rank-00000.pt", size_bytes=1024, digest=f"{index:064x}", algorithm="sha256")
    return CheckpointSaved(
        source="agent", node_id="node-1", job_id=job, rank=0, step=step, path=str(path),
        files=["rank-00000.pt"], world_size=2, file_digests=[digest],
    )  # fmt: skip  # world size 2, one rank reporting: never committed, so nothing is validated or read


async def publish_burst(nats_url: str, root: Path, *, on_half: Callable[[], None], replicas: int = 1) -> Burst:
    """Publish EVENTS reports, 64 in flight; `on_half` runs once half of them were acknowledged."""
    bus = Bus(url=nats_url, service="agent-node-1", replicas=replicas)
    await bus.connect(attempts=20)
    burst, fired = Burst(), False
    subject = subjects.node_event("node-1", "checkpoint.saved")
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(EVENTS):
        queue.put_nowait(index)

    async def worker() -> None:
        nonlocal fired
        while not queue.empty():
            event = report(queue.get_nowait(), root)
            if not await publish_with_retries(bus, subject, event, burst):
                burst.refused += 1  # not acknowledged: may or may not be stored, never counted as sent
                continue
            burst.acked.add((event.job_id, event.step))
            if not fired and len(burst.acked) >= EVENTS // 2:
                fired = True
                # Called on the loop's own thread, blocking it meanwhile: a server started from a passing worker
                # thread would be sent SIGTERM when that thread ends (its parent-death signal follows the thread).
                on_half()

    await asyncio.gather(*(worker() for _ in range(64)))
    await bus.close()
    return burst


async def publish_with_retries(bus: Bus, subject: str, event: CheckpointSaved, burst: Burst) -> bool:
    """Publish until acknowledged, every RETRY_S for at most RETRY_FOR_S, as an agent's outbox retries: the same
    message id each time, so a publish stored before its acknowledgement was lost is deduplicated, not doubled."""
    deadline = time.monotonic() + RETRY_FOR_S
    while True:
        try:
            await bus.publish(subject, event, timeout=2.0)
            return True
        except BusError:
            if time.monotonic() > deadline:
                return False
            burst.retried += 1
            await asyncio.sleep(RETRY_S)


def settle(registry: Registry, burst: Burst, timeout_s: float) -> dict[tuple[str, int], int]:
    """The registry's checkpoints once every acknowledged report is among them (or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = registry.registered()
        if burst.acked <= set(seen) or time.monotonic() > deadline:
            return seen
        time.sleep(1.0)


def check(seen: dict[tuple[str, int], int], burst: Burst) -> None:
    lost = burst.acked - set(seen)
    sent = {(f"chaos-{i % JOBS}", i // JOBS) for i in range(EVENTS)}
    print(
        f"burst of {EVENTS}: {len(burst.acked)} acknowledged ({burst.retried} publishes retried), {burst.refused} "
        f"never acknowledged, {len(seen)} registered"
    )
    assert not lost, f"{len(lost)} acknowledged reports were lost, e.g. {sorted(lost)[:5]}"
    assert set(seen) <= sent, "the registry holds checkpoints nobody reported"
    assert all(count == 1 for count in seen.values()), "a report was registered twice"
    assert not burst.refused, f"{burst.refused} reports were never acknowledged in {RETRY_FOR_S:.0f} s of retries"


def test_nats_killed_9_mid_burst_loses_no_acknowledged_event(
    nats: NatsServer, registry: Registry, tmp_path: Path
) -> None:
    def kill_and_restart() -> None:
        assert nats.process is not None
        nats.process.signal(signal.SIGKILL)
        time.sleep(1.0)
        nats.start()  # same port and store: JetStream recovers its streams from the files

    burst = asyncio.run(publish_burst(nats.url, tmp_path / "ckpt", on_half=kill_and_restart))
    check(settle(registry, burst, timeout_s=300), burst)


def test_registry_killed_9_mid_burst_loses_no_acknowledged_event(
    nats: NatsServer, registry: Registry, tmp_path: Path
) -> None:
    def kill_and_restart() -> None:
        registry.process.signal(signal.SIGKILL)
        time.sleep(0.5)
        registry.start()  # the durable consumer redelivers what the killed process had not acknowledged

    burst = asyncio.run(publish_burst(nats.url, tmp_path / "ckpt", on_half=kill_and_restart))
    check(settle(registry, burst, timeout_s=300), burst)


VALIDATED_SIZE = 2 * 1024**3  # a sparse file: reading it costs no disk, hashing it a few seconds of CPU


def _read_bytes(pid: int) -> int:
    """Bytes the process has read so far (/proc/<pid>/io rchar)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError(f"no rchar in /proc/{pid}/io")


def test_registry_killed_9_mid_validation_validates_the_checkpoint_once_after_restart(
    nats: NatsServer, registry: Registry, tmp_path: Path
) -> None:
    """Validation is level-triggered: a checkpoint whose hashing the kill cut short is still committed, and the
    restarted registry validates it (once), instead of leaving it neither validated nor corrupt."""
    directory = tmp_path / "ckpt" / "chaos-validate" / "step-00000007"
    directory.mkdir(parents=True)
    with (directory / "rank-00000.pt").open("wb") as sink:
        sink.truncate(VALIDATED_SIZE)
    (directory / "COMMITTED").write_text("")
    digest = hashlib.sha256()
    with (directory / "rank-00000.pt").open("rb") as source:
        while chunk := source.read(16 * 1024 * 1024):
            digest.update(chunk)
    api = httpx.Client(base_url=registry.url + "/v1", headers=AUTH, timeout=30)
    begun = api.post(
        "/checkpoints", json={"job_id": "chaos-validate", "step": 7, "path": str(directory), "world_size": 1}
    )
    begun.raise_for_status()
    checkpoint_id = begun.json()["id"]
    files = [
        {"path": "rank-00000.pt", "size_bytes": VALIDATED_SIZE, "digest": digest.hexdigest(), "algorithm": "sha256"}
    ]
    api.put(f"/checkpoints/{checkpoint_id}/ranks/0", json={"files": files}).raise_for_status()
    before = _read_bytes(registry.process.pid)
    api.post(f"/checkpoints/{checkpoint_id}/commit").raise_for_status()

    def hashing() -> bool:  # a quarter of the file read: the validator is in the middle of it
        return _read_bytes(registry.process.pid) - before > VALIDATED_SIZE // 4

    assert wait_until(hashing, timeout_s=60, interval_s=0.01), registry.process.log_tail()
    assert api.get(f"/checkpoints/{checkpoint_id}").json()["state"] == "committed"  # not decided yet
    registry.process.signal(signal.SIGKILL)
    registry.process.proc.wait(timeout=10)  # type: ignore[union-attr]
    registry.start()

    def decided() -> bool:
        return api.get(f"/checkpoints/{checkpoint_id}").json()["state"] != "committed"

    assert wait_until(decided, timeout_s=120, interval_s=0.2), registry.process.log_tail()
    checkpoint = api.get(f"/checkpoints/{checkpoint_id}").json()
    assert checkpoint["state"] == "validated", checkpoint
    listed = api.get("/jobs/chaos-validate/checkpoints").json()["data"]
    assert [(row["id"], row["state"]) for row in listed] == [(checkpoint_id, "validated")]
    assert api.get("/jobs/chaos-validate/checkpoints/latest").json()["id"] == checkpoint_id
    api.close()


def test_one_server_of_a_3_server_nats_cluster_killed_9_mid_burst_loses_nothing(tmp_path: Path) -> None:
    """Streams replicated on 3 servers, as production runs them: one server killed and restarted mid-burst; every
    acknowledged report registered once, and the registry still connected (ready) at the end."""
    cluster = NatsCluster.start_on_free_ports(tmp_path / "nats")
    registry = None
    try:
        registry = start_registry(cluster.url, tmp_path, replicas=3)
        victim = member_serving(cluster, "checkpoint-registry")  # its consumer must move to another member

        def kill_and_restart() -> None:
            assert victim.process is not None
            victim.process.signal(signal.SIGKILL)
            time.sleep(1.0)
            victim.start()  # same ports and store: it catches up from the other two

        burst = asyncio.run(publish_burst(cluster.url, tmp_path / "ckpt", on_half=kill_and_restart, replicas=3))
        check(settle(registry, burst, timeout_s=300), burst)
        assert httpx.get(registry.url + "/readyz", timeout=5).status_code == 200
        assert asyncio.run(replicas_of_agent_stream(cluster.url)) == 3
    finally:
        if registry is not None:
            registry.process.stop()
        cluster.stop()


def member_serving(cluster: NatsCluster, client: str) -> NatsServer:
    """The member a client (by its connection name) is connected to, read off each member's monitoring port."""
    for server in cluster.servers:
        connz = httpx.get(f"http://127.0.0.1:{server.monitor_port}/connz", timeout=5).json()
        if any(connection.get("name") == client for connection in connz.get("connections") or []):
            return server
    raise AssertionError(f"no member of the cluster has a connection named {client}")


async def replicas_of_agent_stream(nats_url: str) -> int:
    bus = Bus(url=nats_url, service="chaos-check", provision=False)
    await bus.connect(attempts=20)
    deadline = time.monotonic() + 60
    try:
        while True:  # the JetStream API may not answer while the restarted member rejoins (a leader election)
            try:
                info = await bus.js.stream_info(subjects.AGENT_STREAM)
            except (TimeoutError, NatsError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1.0)
                continue
            return int(info.config.num_replicas or 1)
    finally:
        await bus.close()
