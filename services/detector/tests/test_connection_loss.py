"""Node loss from the NATS server's client advisories, on a real secured nats-server with real agent processes: a
killed agent's node is lost at once (no report limit involved), a reconnect or a graceful restart is no loss."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import nats.errors
import pytest

from reprise_cli.creds import Credentials, init_credentials
from reprise_cli.servers import NatsServer, deploy_dir
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import SystemClock
from reprise_common.errors import BusError
from reprise_common.events import RankStatus
from reprise_detector.app import create_app
from reprise_detector.settings import DetectorSettings

from .conftest import ADMIN_KEY, Harness, Published, wait_until

NODES = ("node-1", "node-2")
GRACE_S = 0.3
SETTLE_S = 2.0  # well past the grace: a wrong loss would have been decided by then

# An agent as the detector sees it: it reports every 0.2 s on its node's subject with its node's identity; on SIGTERM
# its last report says it is stopping, as the agent's does (services/agent), and it closes its connection.
AGENT = """
import asyncio, signal, sys
from pathlib import Path
from reprise_common import subjects
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import NodeReport

async def main(url: str, seed: str, node: str, every: str = "0.2") -> None:
    interval = float(every)
    inbox = subjects.inbox_prefix(node)
    bus = Bus(url=url, service=f"agent-{node}", nkey_seed_file=Path(seed), inbox_prefix=inbox, provision=False)
    await bus.connect(attempts=40)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("connected", flush=True)
    while not stop.is_set():
        report = NodeReport(
            source=node, node_id=node, interval_s=interval, gpu_backend="sim", connection=bus.connection
        )
        try:
            await bus.publish_snapshot(subjects.node_report(node), report)
        except Exception:
            pass  # not connected: the next one
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            pass
    bye = NodeReport(source=node, node_id=node, interval_s=interval, gpu_backend="sim", stopping=True)
    await bus.publish_snapshot(subjects.node_report(node), bye)
    await bus.close()

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.fixture
def creds(tmp_path: Path) -> Credentials:
    return init_credentials(tmp_path / "creds", nodes=list(NODES), base_config=deploy_dir() / "nats" / "nats.conf")


@pytest.fixture
def secured(creds: Credentials, start_secured_nats: Callable[[Credentials], NatsServer]) -> NatsServer:
    return start_secured_nats(creds)


class Agents:
    """Agent processes, one per node, started and signalled by the test."""

    def __init__(self, server: NatsServer, creds: Credentials) -> None:
        self.server, self.creds = server, creds
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, node: str, *, interval_s: float = 0.2) -> None:
        seed = str(self.creds.agents[node].seed_file)
        command = [sys.executable, "-c", AGENT, self.server.url, seed, node, str(interval_s)]
        process = subprocess.Popen(command, stdout=subprocess.PIPE)
        assert process.stdout is not None and process.stdout.readline().strip() == b"connected"
        self.processes[node] = process

    def signal(self, node: str, sig: signal.Signals) -> None:
        os.kill(self.processes[node].pid, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.processes.pop(node).wait(timeout=10)

    def stop_all(self) -> None:
        for process in self.processes.values():
            process.kill()
            process.wait(timeout=10)


@pytest.fixture
def agents(secured: NatsServer, creds: Credentials) -> Iterator[Agents]:
    started = Agents(secured, creds)
    yield started
    started.stop_all()


async def detector_on(url: str, creds: Credentials, sqlite_url: str, stack: AsyncExitStack, **settings: Any) -> Harness:
    """A detector on `url` with its own identity and the node keys (`settings`: what the test changes), an admin bus
    to place jobs with; both stop with `stack`."""
    admin = Bus(url=url, service="test-orchestrator", nkey_seed_file=creds.admin.seed_file)
    await admin.connect(attempts=40)
    stack.push_async_callback(admin.close)
    app = create_app(
        DetectorSettings(
            nats_url=url,
            nats_nkey_seed_file=creds.services["detector"].seed_file,
            node_keys_file=creds.node_keys,
            database_url=sqlite_url,
            admin_api_key=ADMIN_KEY,
            **({"watch_interval_s": 0.5} | settings),
        ),
        clock=SystemClock(),
    )
    await stack.enter_async_context(app.router.lifespan_context(app))
    client = await stack.enter_async_context(
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://detector",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        )
    )
    h = Harness(app=app, client=client, agents=admin, stack=stack, published=Published(), reports_before=0)
    await h.runtime.wait_started(timeout=30)
    return h


@pytest.fixture
async def harness(secured: NatsServer, creds: Credentials, sqlite_url: str) -> AsyncIterator[Harness]:
    """A detector with its own identity and the node keys; reports never time out here (only connections count)."""
    async with AsyncExitStack() as stack:
        yield await detector_on(
            secured.url, creds, sqlite_url, stack, node_lost_after_s=3600, reconnect_grace_s=GRACE_S
        )


async def _known(h: Harness, *nodes: str) -> bool:
    return all(n in h.runtime.watcher.liveness.nodes for n in nodes)


async def test_a_killed_agents_node_is_lost_from_its_closed_connection(harness: Harness, agents: Agents) -> None:
    # The job is node-2's alone: no rank elsewhere can say whether it goes on, so the closed connection decides.
    await harness.place("job-a", [(0, "node-2", 0)])
    for node in NODES:
        agents.start(node)
    assert await wait_until(lambda: _known(harness, *NODES))
    killed = time.monotonic()
    agents.signal("node-2", signal.SIGKILL)

    async def opened() -> bool:
        return bool(await harness.open_incidents("job-a"))

    assert await wait_until(opened, timeout=10)
    seen_after_s = time.monotonic() - killed
    [incident] = await harness.open_incidents("job-a")
    assert incident["category"] == "node", incident
    assert incident["culprit_node_id"] == "node-2", incident
    assert "node-2 lost: its connection closed (Client Closed)" in incident["root_cause"], incident
    print(f"node loss decided {seen_after_s:.2f} s after the SIGKILL (grace {GRACE_S} s)")


async def test_a_nats_restart_or_a_graceful_agent_restart_loses_no_node(
    harness: Harness, agents: Agents, secured: NatsServer
) -> None:
    await harness.place("job-a", [(0, "node-1", 0), (1, "node-2", 0)])
    for node in NODES:
        agents.start(node)
    assert await wait_until(lambda: _known(harness, *NODES))

    secured.stop()  # every connection drops; agents and the detector reconnect to the restarted server
    secured.start()
    assert await wait_until(lambda: _reconnected(harness), timeout=20)

    agents.signal("node-1", signal.SIGTERM)  # a graceful restart: it says it is stopping, then closes
    agents.start("node-1")
    await asyncio.sleep(SETTLE_S)
    assert await harness.open_incidents("job-a") == []
    assert all(s.dropped_at is None for s in harness.runtime.watcher.liveness.nodes.values())


async def test_a_frozen_agent_still_connected_is_found_by_its_missing_reports(harness: Harness, agents: Agents) -> None:
    harness.runtime.watcher.liveness.lost_after_s = 2.0
    await harness.place("job-a", [(0, "node-1", 0), (1, "node-2", 0)])
    for node in NODES:
        agents.start(node)
    assert await wait_until(lambda: _known(harness, *NODES))
    agents.signal("node-2", signal.SIGSTOP)  # the connection stays open: no advisory

    async def opened() -> bool:
        return bool(await harness.open_incidents("job-a"))

    assert await wait_until(opened, timeout=15)
    [incident] = await harness.open_incidents("job-a")
    assert "node-2 lost: no report for" in incident["root_cause"], incident
    agents.signal("node-2", signal.SIGCONT)


async def test_a_nats_outage_longer_than_every_limit_calls_no_node_lost_and_no_job_hung(
    harness: Harness, secured: NatsServer
) -> None:
    """While the detector's own connection is down it hears nobody: that silence is neither a lost node nor a hang."""
    harness.runtime.watcher.liveness.lost_after_s = 5.0
    await harness.place("job-a", [(0, "node-1", 0), (1, "node-2", 0)], hang_timeout_s=2.0)
    step = 0

    async def training() -> None:  # both ranks step every 0.2 s, as reports show; nothing while NATS is away
        nonlocal step
        while True:
            step += 1
            for rank, node in enumerate(NODES):
                status = RankStatus(job_id="job-a", rank=rank, step=step, phase="training", heartbeat_age_s=0.0)
                with contextlib.suppress(BusError, nats.errors.Error):
                    await harness.report(node, [status])
            await asyncio.sleep(0.2)

    reporting = asyncio.create_task(training())
    try:
        assert await wait_until(lambda: _known(harness, *NODES))
        secured.stop()
        await asyncio.sleep(6.0)  # longer than the report limit (5 s) and the job's hang limit (2 s)
        secured.start()
        assert await wait_until(lambda: _reconnected(harness), timeout=20)
        await asyncio.sleep(SETTLE_S + 1.0)
        assert await harness.open_incidents("job-a") == []
    finally:
        reporting.cancel()


async def _reconnected(h: Harness) -> bool:
    return h.runtime.bus.connected and h.runtime.bus.generation > 1


async def test_a_second_connection_with_a_nodes_identity_closing_is_no_evidence(
    harness: Harness, agents: Agents, secured: NatsServer, creds: Credentials
) -> None:
    """Found from outside: a client that connected with node-2's identity, published and disconnected made node-2 lost
    (and its healthy job restarted) while node-2's own agent was connected and reporting."""
    await harness.place("job-a", [(0, "node-2", 0)])
    agents.start("node-2", interval_s=1.0)  # the agents' default interval: longer than the reconnect grace
    assert await wait_until(lambda: _known(harness, "node-2"))
    assert await wait_until(lambda: _reporting_connection_known(harness, "node-2"))
    for _ in range(3):
        seed = creds.agents["node-2"].seed_file
        other = Bus(
            url=secured.url,
            service="not-the-agent",
            nkey_seed_file=seed,
            inbox_prefix=subjects.inbox_prefix("node-2"),
            provision=False,
        )
        await other.connect(attempts=20)
        await other.nc.publish(subjects.node_event("node-2", "agent.lifecycle"), b"{}")
        await other.nc.flush()
        await other.close()
    await asyncio.sleep(SETTLE_S)
    assert await harness.open_incidents("job-a") == []
    assert harness.runtime.watcher.liveness.nodes["node-2"].dropped_at is None


async def _reporting_connection_known(h: Harness, node: str) -> bool:
    return bool(h.runtime.watcher.liveness.reporting_connection(node))


async def _train(
    h: Harness, ranks: dict[int, str], steps: Callable[[], int], phase: Callable[[], str] = lambda: "training"
) -> None:
    """Report the job's ranks on their nodes every 0.2 s at the step `steps` says, as their agents would."""
    while True:
        step = steps()
        for rank, node in ranks.items():
            status = RankStatus(job_id="job-a", rank=rank, step=step, phase=phase(), heartbeat_age_s=0.0)
            with contextlib.suppress(BusError, nats.errors.Error):
                await h.report(node, [status])
        await asyncio.sleep(0.2)


async def test_a_silent_node_whose_jobs_other_ranks_advance_is_unreachable_not_lost(
    harness: Harness, agents: Agents
) -> None:
    """A node's management link cut while its ranks train over the data link: its agent falls silent (stopped here,
    its connection left open as a cut link leaves it), the job's ranks on node-1 go on advancing, but for a save of
    2 s in the middle. Past the report limit the node is said unreachable once (a warning); it is never lost, nothing
    is recovered."""
    liveness = harness.runtime.watcher.liveness
    liveness.lost_after_s, liveness.unreachable_after_s = 2.0, 3.0
    await harness.place("job-a", [(0, "node-1", 0), (1, "node-2", 0)])
    agents.start("node-2")
    clock = time.monotonic()

    def saving() -> bool:  # the job saves a checkpoint 4 to 6 s after it starts: no step, another phase
        return 4.0 <= time.monotonic() - clock < 6.0

    frozen: list[int] = []

    def steps() -> int:
        if not saving():
            frozen.clear()
            return int((time.monotonic() - clock) * 10)
        frozen[:] = frozen or [int((time.monotonic() - clock) * 10)]
        return frozen[0]

    phase = lambda: "checkpointing" if saving() else "training"  # noqa: E731
    training = asyncio.create_task(_train(harness, {0: "node-1"}, steps, phase))
    try:
        assert await wait_until(lambda: _known(harness, *NODES))
        await asyncio.sleep(1.0)
        agents.signal("node-2", signal.SIGSTOP)
        await asyncio.sleep(7.0)  # over three times the report limit, the save in the middle
        incidents = await harness.open_incidents("job-a")
        assert [i["severity"] for i in incidents] == ["warning"], incidents
        assert "node-2 unreachable: no report for" in incidents[0]["root_cause"], incidents
        assert incidents[0]["recommended_action"] == "none", incidents
        assert liveness.nodes["node-2"].state == "alive"
    finally:
        training.cancel()
        agents.signal("node-2", signal.SIGCONT)


async def test_a_silent_node_whose_jobs_other_ranks_stop_with_it_is_lost_before_the_limit(
    harness: Harness, agents: Agents
) -> None:
    """A host gone without a word (power lost: its agent silent, its connection left open): the job's ranks on node-1
    stop advancing with it. It is lost seconds before the report limit, on that evidence."""
    liveness = harness.runtime.watcher.liveness
    liveness.lost_after_s = 30.0
    await harness.place("job-a", [(0, "node-1", 0), (1, "node-2", 0)])
    agents.start("node-2")
    stopped_at: list[float] = []
    clock = time.monotonic()

    def steps() -> int:  # the step node-1's rank reaches: none after node-2 went away
        return int(((stopped_at[0] if stopped_at else time.monotonic()) - clock) * 10)

    training = asyncio.create_task(_train(harness, {0: "node-1"}, steps))
    try:
        assert await wait_until(lambda: _known(harness, *NODES))
        await asyncio.sleep(1.0)
        agents.signal("node-2", signal.SIGSTOP)
        stopped_at.append(time.monotonic())

        async def lost() -> bool:
            return any(i["category"] == "node" for i in await harness.open_incidents("job-a"))

        assert await wait_until(lost, timeout=10)
        print(f"node loss decided {time.monotonic() - stopped_at[0]:.2f} s after the host went silent")
        [incident] = await harness.open_incidents("job-a")
        assert incident["culprit_node_id"] == "node-2", incident
        assert "stopped advancing with it" in incident["root_cause"], incident
    finally:
        training.cancel()
        agents.signal("node-2", signal.SIGCONT)


async def test_a_rank_on_a_silent_node_is_not_hung_while_its_peers_advance(harness: Harness) -> None:
    """Found on namespaced hosts: a 60 s cut of node-2's management link made its job hung 15 s in ("rank 1 stopped
    first"): its rank's progress was unknown, not stalled. Its node's silence is liveness's to judge."""
    await harness.place("job-a", [(0, "node-1", 0), (1, "node-2", 0)], hang_timeout_s=2.0)
    clock = time.monotonic()
    both = asyncio.create_task(
        _train(harness, {0: "node-1", 1: "node-2"}, lambda: int((time.monotonic() - clock) * 10))
    )
    try:
        assert await wait_until(lambda: _known(harness, *NODES))
        await asyncio.sleep(1.0)
    finally:
        both.cancel()
    one = asyncio.create_task(_train(harness, {0: "node-1"}, lambda: int((time.monotonic() - clock) * 10)))
    try:
        await asyncio.sleep(6.0)  # three times the job's hang limit: node-2 silent, node-1's rank advancing
        assert await harness.open_incidents("job-a") == []
    finally:
        one.cancel()
