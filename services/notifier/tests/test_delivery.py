"""Delivery against the Slack-compatible receiver over real HTTP, with events from a real nats-server.

The timing checks are protocol facts, read from the receiver's own arrival and answer times: no request before a
429's Retry-After has elapsed, and never two requests to one webhook closer than its minimum interval.
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from reprise_cli.slack_receiver import Received, SlackReceiver

Harness = Any  # the start_notifier fixture's harness (tests/conftest.py)
TOLERANCE_S = 0.02  # the receiver's clock reads arrival a little after the socket accepted the request


def delivered_ids(receiver: SlackReceiver) -> list[str]:
    """Delivery ids of every alert in a message the receiver accepted (each alert's section carries its id)."""
    return [i for m in receiver.messages() if m.status == 200 for i in m.block_ids()]


def gaps(messages: list[Received]) -> list[float]:
    """Seconds between consecutive arrivals."""
    return [b.arrived - a.arrived for a, b in itertools.pairwise(messages)]


async def test_an_incident_and_its_recovery_reach_slack_and_quiet_updates_do_not(
    *,
    start_notifier: Any,
    receiver: SlackReceiver,
    slack_url: str,
    make_incident: Any,
    make_recovery: Any,
    wait_for: Any,
) -> None:
    notifier = await start_notifier(notifier_slack_url=SecretStr(slack_url), dashboard_url="https://reprise.example")
    opened = make_incident("llm-7b")
    await notifier.publish(opened)
    await notifier.publish(make_incident("llm-7b", "updated", incident_id=opened.incident_id, seq=2))
    await notifier.publish(make_recovery(opened, "step", step="stopping_ranks", detail=""))
    await wait_for(lambda: len(delivered_ids(receiver)) >= 1)  # sent alone, so the recovery is not coalesced with it
    await notifier.publish(make_recovery(opened))
    await wait_for(lambda: len(delivered_ids(receiver)) >= 2)
    await notifier.settled()

    sent = await notifier.get("/v1/deliveries")
    assert sorted(d["kind"] for d in sent["data"]) == ["opened", "recovered"]  # the quiet ones were not queued
    bodies = " ".join(m.body for m in receiver.messages())
    assert "XID 79: GPU fell off the bus" in bodies
    assert "node node-2 · GPU 1 · rank 3" in bodies
    assert f"https://reprise.example/incidents/{opened.incident_id}" in bodies
    recovered = next(m.payload() for m in receiver.messages() if "Recovered" in m.body)
    assert recovered["text"].startswith("Recovered: job llm-7b")  # the plain-text fallback
    fields = [f["text"] for block in recovered["blocks"] for f in block.get("fields", [])]
    assert "*Time to recover*\n42 s" in fields  # 40 s after the incident, which came 2 s after its first symptom
    assert any("training relaunched" in field for field in fields)


async def test_no_request_before_retry_after_has_elapsed(
    start_notifier: Any, receiver: SlackReceiver, slack_url: str, make_incident: Any, wait_for: Any
) -> None:
    receiver.script({"answer": "rate_limited", "retry_after": 2}, {"answer": "rate_limited", "retry_after": 1})
    notifier = await start_notifier(notifier_slack_url=SecretStr(slack_url))
    await notifier.publish(make_incident())
    await wait_for(lambda: len(delivered_ids(receiver)) == 1)
    await wait_for(lambda: _count(notifier, state="sent", expected=1))  # the receiver answers before it is recorded

    first, second, third = receiver.messages()
    assert (first.status, second.status, third.status) == (429, 429, 200)
    assert second.arrived >= first.answered + 2
    assert third.arrived >= second.answered + 1
    [delivery] = (await notifier.get("/v1/deliveries", state="sent"))["data"]
    assert delivery["attempts"] == 3


async def test_a_burst_is_coalesced_and_paced_to_one_message_per_second(
    start_notifier: Any, receiver: SlackReceiver, slack_url: str, make_incident: Any, wait_for: Any
) -> None:
    notifier = await start_notifier(notifier_slack_url=SecretStr(slack_url), coalesce_max=5)
    for index in range(20):
        await notifier.publish(make_incident(f"job-{index}"))
    await wait_for(lambda: len(delivered_ids(receiver)) >= 20, timeout=30)

    messages = receiver.messages()
    ids = delivered_ids(receiver)
    queued = await notifier.get("/v1/deliveries", limit=1000)
    assert sorted(ids) == sorted(d["id"] for d in queued["data"])  # every alert once, none twice
    assert len(messages) < 20  # coalesced: several alerts per message
    assert all(len(m.block_ids()) <= 5 for m in messages)
    assert min(gaps(messages)) >= 1.0 - TOLERANCE_S, gaps(messages)
    print(f"20 alerts in {len(messages)} messages; gaps {[round(g, 3) for g in gaps(messages)]}")


async def test_every_alert_is_delivered_once_the_receiver_recovers_from_500s(
    start_notifier: Any, receiver: SlackReceiver, slack_url: str, make_incident: Any, wait_for: Any
) -> None:
    receiver.script("server_error", "server_error", "server_error")
    notifier = await start_notifier(
        notifier_slack_url=SecretStr(slack_url), slack_min_interval_s=0.2, retry_base_s=0.1, retry_max_s=0.4
    )
    for index in range(3):
        await notifier.publish(make_incident(f"job-{index}"))
    await wait_for(lambda: len(set(delivered_ids(receiver))) == 3, timeout=30)
    await wait_for(lambda: _count(notifier, state="sent", expected=3))

    statuses = [m.status for m in receiver.messages()]
    assert statuses[:3] == [500, 500, 500] and set(statuses[3:]) == {200}
    assert Counter(delivered_ids(receiver)).most_common(1)[0][1] == 1  # delivered once each
    assert min(gaps(receiver.messages())) >= 0.2 - TOLERANCE_S
    assert (await notifier.get("/v1/deliveries", state="pending"))["count"] == 0
    assert (await notifier.get("/v1/dead-letters"))["count"] == 0


@pytest.mark.parametrize(
    ("answer", "status"), [("no_service", 404), ("channel_is_archived", 410), ("invalid_payload", 400)]
)
async def test_a_permanent_refusal_is_dead_lettered_after_exactly_one_request(
    *,
    start_notifier: Any,
    receiver: SlackReceiver,
    slack_url: str,
    make_incident: Any,
    wait_for: Any,
    answer: str,
    status: int,
) -> None:
    receiver.script(answer)
    notifier = await start_notifier(notifier_slack_url=SecretStr(slack_url), slack_min_interval_s=0.2)
    before = _dead_letter_count(await notifier.client.get("/metrics"))
    refused = make_incident("job-refused")
    await notifier.publish(refused)
    await wait_for(lambda: len(receiver.messages()) == 1)
    # A later alert goes out on its own: the refused one is never retried, with it or alone.
    await notifier.publish(make_incident("job-later"))
    await wait_for(lambda: len(delivered_ids(receiver)) == 1)
    await notifier.settled()

    first, second = receiver.messages()
    assert (first.status, first.answer, second.status) == (status, answer, 200)
    [letter] = (await notifier.get("/v1/dead-letters"))["data"]
    assert (letter["job_id"], letter["reason"], letter["status"]) == ("job-refused", "rejected", status)
    assert answer in letter["detail"]
    assert letter["id"] not in second.block_ids()
    dead = await notifier.get("/v1/deliveries", state="dead")
    assert [d["id"] for d in dead["data"]] == [letter["id"]]
    assert _dead_letter_count(await notifier.client.get("/metrics")) == before + 1


async def _count(notifier: Harness, *, state: str, expected: int) -> bool:
    """True once the notifier has recorded `expected` deliveries in a state."""
    return bool((await notifier.get("/v1/deliveries", state=state))["count"] == expected)


def _dead_letter_count(response: Any) -> float:
    for line in response.text.splitlines():
        if line.startswith("reprise_notifier_dead_letters_total{") and 'reason="rejected"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_redelivered_event_adds_no_second_delivery(
    start_notifier: Any, receiver: SlackReceiver, slack_url: str, make_incident: Any, wait_for: Any
) -> None:
    notifier = await start_notifier(notifier_slack_url=SecretStr(slack_url))
    event = make_incident()
    await notifier.publish(event, msg_id="first-publish")
    await notifier.publish(event, msg_id="second-publish")  # two stream messages, one event id
    await notifier.settled()
    await wait_for(lambda: len(delivered_ids(receiver)) == 1)

    assert (await notifier.get("/v1/deliveries"))["count"] == 1
    assert len(receiver.messages()) == 1


async def test_alerts_reach_the_team_their_job_labels_name(
    *,
    start_notifier: Any,
    receiver: SlackReceiver,
    slack_url: str,
    make_incident: Any,
    make_recovery: Any,
    wait_for: Any,
    tmp_path: Path,
) -> None:
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        """
version: 1
destinations:
  ml-hook: {kind: webhook, url_env: ML_URL, secret_env: ML_SECRET}
teams:
  ml: {labels: {team: ml}}
routes:
  - {name: ml-team, match: {team: ml}, to: ml-hook}
"""
    )
    environ = {"ML_URL": f"{receiver.url}/hooks/ml", "ML_SECRET": "a-signing-secret-of-some-length"}
    notifier = await start_notifier(
        notifier_routes_file=routes, environ=environ, notifier_slack_url=SecretStr(slack_url)
    )
    labels = {"team": "ml", "example.com/tier": "gold"}
    ml = make_incident("job-7", labels=labels)  # the job id says nothing of its team: the labels do
    await notifier.publish(ml)
    await notifier.publish(make_incident("job-8"))  # no labels: no team takes it, the default route does
    await wait_for(lambda: len(receiver.messages("/hooks/ml")) == 1)  # the recovery is sent on its own
    await notifier.publish(make_recovery(ml, "failed", step="launching", detail="launch not confirmed"))
    await wait_for(lambda: sum(len(m.payload()["alerts"]) for m in receiver.messages("/hooks/ml")) == 2)
    await wait_for(lambda: len(delivered_ids(receiver)) == 1)
    await notifier.settled()

    alerts = [a for m in receiver.messages("/hooks/ml") for a in m.payload()["alerts"]]
    assert [(a["kind"], a["job_id"], a["labels"]) for a in alerts] == [
        ("opened", "job-7", labels),
        ("failed", "job-7", labels),
    ]
    [slack_message] = [m for m in receiver.messages() if m.path != "/hooks/ml"]
    assert "job-8" in slack_message.body and "job-7" not in slack_message.body
    queued = (await notifier.get("/v1/deliveries"))["data"]
    assert sorted((d["destination"], d["job_id"], d["kind"]) for d in queued) == [
        ("default-slack", "job-8", "opened"),
        ("ml-hook", "job-7", "failed"),
        ("ml-hook", "job-7", "opened"),
    ]
