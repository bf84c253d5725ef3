"""Signed JSON webhooks: what the notifier sends verifies with the documented function; anything altered does not."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from reprise_cli.slack_receiver import SlackReceiver
from reprise_common.events import Culprit
from reprise_notifier.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, check_secret, sign, verify

SECRET = "whsec-0123456789abcdef"


def test_a_signature_verifies_and_any_change_breaks_it() -> None:
    body, now = b'{"alerts":[]}', int(time.time())
    signature = sign(SECRET.encode(), now, body)
    assert signature.startswith("v1=") and len(signature) == 3 + 64
    assert verify(SECRET.encode(), body, str(now), signature)
    assert not verify(SECRET.encode(), body + b" ", str(now), signature)  # body changed
    assert not verify(b"another-secret-of-length", body, str(now), signature)  # wrong secret
    assert not verify(SECRET.encode(), body, str(now + 1), signature)  # timestamp changed
    assert not verify(SECRET.encode(), body, "soon", signature)
    assert not verify(SECRET.encode(), body, str(now), signature.replace("v1=", "v0="))


def test_old_timestamps_are_refused_and_rotation_accepts_either_secret() -> None:
    body, sent = b"{}", 1_700_000_000
    signature = sign(SECRET.encode(), sent, body)
    assert verify(SECRET.encode(), body, str(sent), signature, now=sent + 299)
    assert not verify(SECRET.encode(), body, str(sent), signature, now=sent + 301)  # a replay
    rotating = f"{sign(b'the-old-secret-value', sent, body)}, {signature}"
    assert verify(SECRET.encode(), body, str(sent), rotating, now=sent)


@pytest.mark.parametrize("secret", ["changeme", "short", "<your secret here>", "secret"])
def test_placeholder_secrets_are_refused(secret: str) -> None:
    with pytest.raises(ValueError, match="real secret"):
        check_secret("the secret", secret)


async def test_a_webhook_request_verifies_at_the_receiver(
    *,
    start_notifier: Any,
    receiver: SlackReceiver,
    make_incident: Any,
    make_recovery: Any,
    wait_for: Any,
    tmp_path: Path,
) -> None:
    secret_file = tmp_path / "hook-secret"
    secret_file.write_text(SECRET + "\n")
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        f"""
version: 1
destinations:
  pager: {{kind: webhook, url_env: PAGER_URL, secret_file: {secret_file}}}
routes:
  - {{name: all, to: pager, match: {{kind: [opened, failed]}}}}
"""
    )
    notifier = await start_notifier(notifier_routes_file=routes, environ={"PAGER_URL": f"{receiver.url}/hooks/pager"})
    culprit = Culprit(node_id="node-2", gpu=1, rank=3, exit_code=-9, restart_epoch=2, fault_step=1200)
    opened = make_incident("job-9", culprit=culprit)
    await notifier.publish(opened)
    await notifier.publish(make_recovery(opened, "failed", step="launching", detail="launch not confirmed"))
    await wait_for(lambda: sum(len(json.loads(m.body)["alerts"]) for m in receiver.messages()) == 2)

    alerts = []
    for message in receiver.messages():
        headers = {key.lower(): value for key, value in message.headers.items()}
        timestamp, signature = headers[TIMESTAMP_HEADER.lower()], headers[SIGNATURE_HEADER.lower()]
        assert verify(SECRET.encode(), message.body.encode(), timestamp, signature)
        assert not verify(SECRET.encode(), message.body.replace("job-9", "job-8").encode(), timestamp, signature)
        body = json.loads(message.body)
        assert body["version"] == 1 and body["message_id"] == headers["x-reprise-message-id"]
        alerts += body["alerts"]
    assert [a["kind"] for a in alerts] == ["opened", "failed"]
    failed = alerts[1]
    assert (failed["root_cause"], failed["culprit"]["node_id"]) == ("XID 79: GPU fell off the bus", "node-2")
    assert failed["culprit"] == culprit.model_dump(mode="json")  # the recovery alert names the whole culprit
    assert "failed at launching: launch not confirmed" in failed["action_taken"]

    async def both_recorded() -> bool:
        return bool((await notifier.get("/v1/deliveries", state="sent"))["count"] == 2)

    await wait_for(both_recorded)  # the receiver answers before the notifier records the answer
    sent = {d["id"] for d in (await notifier.get("/v1/deliveries", state="sent"))["data"]}
    assert {a["id"] for a in alerts} == sent  # receivers deduplicate on these ids
