"""A webhook URL is a secret: it never appears in a log record, an error, a REST answer or a metric.

Destinations here fail in every way a URL could leak through: a 500 and a 404 from the receiver, and a webhook
whose port nobody listens on (connection refused, retried).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from reprise_cli.servers import free_port
from reprise_cli.slack_receiver import SlackReceiver
from reprise_common.logging import JsonFormatter

SINK_PATH = "sink/ZZsinkSECRETpath987"
CLOSED_PATH = "closed/QQclosedSECRETpath654"


async def test_no_url_in_logs_answers_or_metrics(
    *,
    start_notifier: Any,
    receiver: SlackReceiver,
    secret_path: str,
    make_incident: Any,
    wait_for: Any,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    caplog.set_level(logging.DEBUG)
    sink_url_file = tmp_path / "sink-url"
    sink_url_file.write_text(receiver.url + "/hooks/" + SINK_PATH + "\n")
    closed_url = f"http://127.0.0.1:{free_port()}/{CLOSED_PATH}"
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        f"""
version: 1
destinations:
  ops: {{kind: slack, url_env: OPS_SLACK_URL}}
  sink: {{kind: webhook, url_file: {sink_url_file}, secret_env: SINK_SECRET}}
  broken: {{kind: webhook, url_env: BROKEN_URL, secret_env: SINK_SECRET}}
routes:
  - {{name: everything, to: [ops, sink, broken]}}
"""
    )
    environ = {
        "OPS_SLACK_URL": receiver.webhook_url(secret_path),
        "BROKEN_URL": closed_url,
        "SINK_SECRET": "a-long-enough-signing-secret",
    }
    receiver.script("server_error", "no_service", path=f"/services/{secret_path}")
    notifier = await start_notifier(
        notifier_routes_file=routes,
        environ=environ,
        retry_base_s=0.1,
        retry_max_s=0.2,
        slack_min_interval_s=0.2,
        webhook_min_interval_s=0.1,
    )
    await notifier.publish(make_incident("job-a"))
    await wait_for(lambda: len(receiver.messages(f"/services/{secret_path}")) == 2)  # the 500, then the 404
    await notifier.publish(make_incident("job-b"))
    await wait_for(lambda: [m.status for m in receiver.messages(f"/services/{secret_path}")] == [500, 404, 200])

    async def broken_failed_twice() -> bool:
        destinations = (await notifier.client.get("/v1/destinations")).json()["data"]
        return any(d["name"] == "broken" and d["failures"] >= 2 for d in destinations)

    await wait_for(broken_failed_twice)
    await notifier.settled()

    seen = [JsonFormatter("notifier").format(record) for record in caplog.records]
    for path in ("/v1/deliveries", "/v1/dead-letters", "/v1/destinations", "/metrics", "/readyz", "/openapi.json"):
        seen.append((await notifier.client.get(path, params={"limit": 1000} if path.startswith("/v1/d") else {})).text)
    seen += [repr(notifier.runtime.routing), repr(notifier.runtime.settings), str(notifier.runtime.routing)]
    destinations = {d["name"]: d for d in (await notifier.get("/v1/destinations"))["data"]}
    assert set(destinations) == {"ops", "sink", "broken"}
    assert destinations["broken"]["last_error"], "the refused connection left no reason"
    assert (await notifier.get("/v1/dead-letters"))["count"] == 1  # the 404
    text = "\n".join(seen)
    for secret in (secret_path, SINK_PATH, CLOSED_PATH, closed_url, environ["SINK_SECRET"]):
        assert secret not in text, f"{secret!r} leaked"
