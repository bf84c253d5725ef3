"""Longer management cuts (`make chaos` only): node-2's management link gone 10 s and 60 s while its ranks train.

What must hold (issue 39): no recovery and no node-loss incident; the job trains on at the same epoch through the
cut. A long silence is told to the operator once, as node-2 unreachable (a warning whose action is none):
at most one such incident for 10 s; for 60 s exactly one, and one Slack alert naming node-2, and the detector's
node view shows node-2 silent meanwhile.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from .harness import PartitionedJob, ride_out

pytestmark = [pytest.mark.stack, pytest.mark.chaos, pytest.mark.timeout(900)]


def slack_lines(job: PartitionedJob) -> list[dict[str, Any]]:
    """Every message the local Slack receiver got so far."""
    path = Path(job.stack.config.state_dir).resolve() / "slack-receiver.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def node_health(job: PartitionedJob, node_id: str) -> dict[str, Any]:
    """What the detector shows of a node (the dashboard's node page): its liveness and its last report's age."""
    try:
        answer = job.client.http.get(f"{job.stack.url('detector')}/v1/node-health/{node_id}", timeout=2)
        body: dict[str, Any] = answer.raise_for_status().json()
        return body
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": repr(exc)}


def told_once(job: PartitionedJob, seconds: float, *, exactly: bool) -> None:
    """Cut for `seconds`: nothing recovered, no node loss, the job trained through, and at most (`exactly`: exactly)
    one unreachable warning for node-2 and one Slack alert about it."""
    alerts = len(slack_lines(job))
    shown: list[dict[str, Any]] = []
    sampler = threading.Timer(seconds * 0.75, lambda: shown.append(node_health(job, "node-2")))
    sampler.start()
    seen = ride_out(job, seconds=seconds)
    sampler.join()
    about_node_2 = [m for m in slack_lines(job)[alerts:] if "node-2" in m["body"]]
    warnings = [i for i in seen.incidents if i["recommended_action"] == "none" and i["culprit_node_id"] == "node-2"]
    health = {k: shown[0].get(k) for k in ("state", "last_report_age_s", "error")} if shown else None
    print(f"{seconds:g} s: 3/4 through, the detector showed node-2 {health}; {len(about_node_2)} Slack message(s)")
    assert seen.recoveries == 0, job.recoveries()[0]["detail"]
    assert not [i for i in seen.incidents if i not in warnings], [i["root_cause"] for i in seen.incidents]
    assert seen.trained_through() and seen.back is not None, seen
    if exactly:
        assert (len(warnings), len(about_node_2)) == (1, 1), (warnings, about_node_2)
        assert "unreachable" in warnings[0]["root_cause"], warnings[0]["root_cause"]
        assert health is not None and (health["last_report_age_s"] or 0) >= seconds * 0.5, health  # shown silent
    else:
        assert len(warnings) <= 1, warnings


def test_management_cut_of_10s_is_no_node_loss(training: PartitionedJob) -> None:
    told_once(training, 10.0, exactly=False)


def test_management_cut_of_60s_is_one_unreachable_alert_and_no_restart(training: PartitionedJob) -> None:
    time.sleep(1.0)  # the 10 s case's reports settled
    told_once(training, 60.0, exactly=True)
