"""The Slack-compatible receiver answers as Slack does, scripts answers on demand and records every request."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from reprise_cli.servers import free_port, wait_until
from reprise_cli.slack_receiver import SlackReceiver, check_slack_payload


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[SlackReceiver]:
    """A receiver on a free port."""
    found = SlackReceiver(log_path=tmp_path / "requests.jsonl").start()
    yield found
    found.stop()


def test_scripted_answers_then_ok_and_every_request_recorded(receiver: SlackReceiver, tmp_path: Path) -> None:
    url = receiver.webhook_url("T1/B1/abc")
    script = {"answers": [{"answer": "rate_limited", "retry_after": 3}, "no_service", "channel_is_archived"]}
    assert httpx.post(f"{receiver.url}/script", json=script).status_code == 200
    receiver.script("server_error", "invalid_payload")  # from Python too, for any path, after the path's own
    answers = [httpx.post(url, json={"text": f"m{i}"}) for i in range(6)]

    assert [(a.status_code, a.text) for a in answers] == [
        (429, "rate_limited"),
        (404, "no_service"),
        (410, "channel_is_archived"),
        (500, "internal_error"),
        (400, "invalid_payload"),
        (200, "ok"),
    ]
    assert answers[0].headers["Retry-After"] == "3"
    recorded = httpx.get(f"{receiver.url}/messages", params={"path": "/services/T1/B1/abc"}).json()
    assert [r["status"] for r in recorded] == [429, 404, 410, 500, 400, 200]
    assert all(r["arrived"] <= r["answered"] for r in recorded)
    assert [json.loads(r["body"])["text"] for r in recorded] == [f"m{i}" for i in range(6)]
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert [json.loads(line)["status"] for line in lines] == [429, 404, 410, 500, 400, 200]


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ({"text": "hi"}, None),
        ({"blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": "x" * 3000}}]}, None),
        ({}, "no_text"),
        ({"blocks": [{"type": "divider"}] * 51}, "invalid_blocks"),
        (
            {"text": "t", "blocks": [{"type": "header", "text": {"type": "plain_text", "text": "h" * 151}}]},
            "invalid_blocks",
        ),
        (
            {"text": "t", "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": "x" * 3001}}]},
            "invalid_blocks",
        ),
        ({"text": "t", "blocks": [{"type": "divider", "block_id": "a"}] * 2}, "invalid_blocks"),
    ],
)
def test_it_refuses_what_slack_refuses(payload: dict[str, object], error: str | None) -> None:
    assert check_slack_payload(json.dumps(payload)) == error


def test_bad_payloads_get_slacks_400(receiver: SlackReceiver) -> None:
    answer = httpx.post(receiver.webhook_url(), content=b"not json")
    assert (answer.status_code, answer.text) == (400, "invalid_payload")
    assert httpx.post(f"{receiver.url}/hooks/any", content=b"[1]").status_code == 200  # a generic webhook sink
    assert httpx.post(f"{receiver.url}/script", json={"answers": ["nonsense"]}).status_code == 400


def test_the_page_lists_messages_escaped(receiver: SlackReceiver) -> None:
    httpx.post(receiver.webhook_url(), json={"text": "<script>alert(1)</script> rank 3 died"})
    page = httpx.get(receiver.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "&lt;script&gt;alert(1)&lt;/script&gt; rank 3 died" in page.text and "<script>" not in page.text
    httpx.post(f"{receiver.url}/reset")
    assert httpx.get(f"{receiver.url}/messages").json() == []


def test_it_runs_as_a_command_and_stops_on_sigterm(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "slack.jsonl"
    argv = [sys.executable, "-m", "reprise_cli.slack_receiver", "--port", str(port), "--log", str(log)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:

        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).text == "ok"
            except httpx.HTTPError:
                return False

        assert wait_until(up, timeout_s=15)
        assert httpx.post(f"http://127.0.0.1:{port}/services/x", json={"text": "hello"}).text == "ok"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert json.loads(log.read_text())["body"] == '{"text":"hello"}'
