"""`python -m reprise_notifier` as a real process, SIGKILLed in the middle of a burst and started again: every alert
is delivered, duplicates are bounded by the one message that was in flight, and the URL never reaches its log."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

from reprise_cli.servers import ManagedProcess, NatsServer, free_port, wait_until
from reprise_cli.slack_receiver import SlackReceiver
from reprise_common import subjects
from reprise_common.aio import poll_until
from reprise_common.bus import Bus
from reprise_common.events import IncidentChange
from reprise_notifier.deliveries.models import delivery_id
from reprise_notifier.routing import DEFAULT_SLACK

BURST = 30
COALESCE_MAX = 5


def _start(env: dict[str, str], log: Path, port: int) -> ManagedProcess:
    process = ManagedProcess("notifier", [sys.executable, "-m", "reprise_notifier"], log, env)
    process.start()

    def ready() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_until(ready, timeout_s=30), process.log_tail()
    return process


@pytest.mark.chaos
async def test_sigkill_mid_burst_loses_no_alert(
    nats_server: NatsServer,
    receiver: SlackReceiver,
    secret_path: str,
    make_incident: object,
    tmp_path: Path,
) -> None:
    port = free_port()
    env = {
        "REPRISE_NATS_URL": nats_server.url,
        "REPRISE_DATABASE_URL": f"sqlite:///{tmp_path / 'notifier.db'}",
        "REPRISE_HTTP_PORT": str(port),
        "REPRISE_STATE_DIR": str(tmp_path / "state"),
        "REPRISE_LOG_FORMAT": "json",
        "REPRISE_LOG_LEVEL": "DEBUG",
        "REPRISE_NOTIFIER_SLACK_URL": receiver.webhook_url(secret_path),
        "REPRISE_COALESCE_MAX": str(COALESCE_MAX),
        "REPRISE_ACK_WAIT_S": "2",  # what the killed process held unacknowledged comes back after 2 s
    }
    log = tmp_path / "notifier.log"
    platform = Bus(url=nats_server.url, service="test-platform")
    await platform.connect(attempts=20)
    process = await asyncio.to_thread(_start, env, log, port)
    events: list[IncidentChange] = [make_incident(f"job-{i}") for i in range(BURST)]  # type: ignore[operator]
    try:
        for event in events[:12]:
            await platform.publish(subjects.incident(event.job_id, "opened"), event)
            await asyncio.sleep(0.05)
        assert await poll_until(lambda: len(receiver.messages()) >= 2, timeout_s=15)
        process.signal(signal.SIGKILL)  # mid-burst: alerts queued, one message possibly in flight
        await asyncio.to_thread(process.proc.wait if process.proc else lambda: None)
        for event in events[12:]:  # the rest of the burst arrives while the notifier is down
            await platform.publish(subjects.incident(event.job_id, "opened"), event)
        process = await asyncio.to_thread(_start, env, log, port)

        expected = {delivery_id(e.event_id, DEFAULT_SLACK) for e in events}

        def delivered() -> list[str]:
            return [i for m in receiver.messages() if m.status == 200 for i in m.block_ids()]

        assert await poll_until(lambda: expected <= set(delivered()), timeout_s=60), (
            f"missing {len(expected - set(delivered()))} alerts"
        )
    finally:
        await asyncio.to_thread(process.stop, 15.0)
        await platform.close()

    duplicates = sum(count - 1 for count in Counter(delivered()).values())
    messages = receiver.messages()
    print(f"{BURST} alerts, {len(messages)} messages, {duplicates} duplicate alert(s) after SIGKILL and restart")
    assert set(delivered()) == expected
    assert duplicates <= COALESCE_MAX  # at most the one message in flight when the process died
    gaps = [b.arrived - a.arrived for a, b in itertools.pairwise(messages)]
    assert min(gaps) >= 1.0 - 0.02, gaps
    text = log.read_text()
    assert '"service": "notifier"' in text and "alerts delivered" in text
    assert secret_path not in text and receiver.url not in text
    assert os.environ.get("REPRISE_NOTIFIER_SLACK_URL") is None  # the test itself did not leak it to others
