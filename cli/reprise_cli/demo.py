"""`reprise demo` (walking skeleton): the platform on real processes, a job, an injected XID 79, the recovery."""

from __future__ import annotations

import shutil
import sys
import time
from datetime import datetime
from typing import Any

from reprise_cli.client import PlatformClient, poll
from reprise_cli.stack import Stack
from reprise_cli.topology import StackConfig
from reprise_common.errors import ConfigError
from reprise_common.events import FaultKind, InjectFault


def _seconds(start: str, end: str | None) -> float | None:
    if end is None:
        return None
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()


def _say(text: str) -> None:
    print(text, flush=True)


def run_demo(config: StackConfig) -> int:
    """Run the scenario; 0 when the job was recovered, 1 otherwise."""
    shutil.rmtree(config.state_dir, ignore_errors=True)  # a demo starts from nothing, whatever ran before
    stack = Stack(config, say=_say)
    try:
        _say(f"[demo] starting the platform: {config.nodes} nodes, {config.spares} spares (logs in {stack.log_dir})")
        started = time.monotonic()
        stack.start()
        _say(f"[demo] every service ready in {time.monotonic() - started:.1f}s")
        client = PlatformClient(
            orchestrator=stack.url("orchestrator"),
            detector=stack.url("detector"),
            registry=stack.url("checkpoint-registry"),
            nats_url=config.nats_url,
            nkey_seed_file=stack.platform_seed,
        )
        try:
            return _scenario(client, config)
        finally:
            client.close()
    except ConfigError as exc:
        print(f"reprise demo: {exc}", file=sys.stderr)
        return 2
    finally:
        stack.stop()
        _say("[demo] platform stopped")


def _scenario(client: PlatformClient, config: StackConfig) -> int:
    nodes = poll(client.nodes, lambda n: len(n) >= config.nodes + config.spares, timeout_s=15)
    _say(f"[demo] {len(nodes)} nodes reporting: {', '.join(n['node_id'] for n in nodes)}")
    job = client.submit_job(name="demo-ticker", node_count=config.nodes, ranks_per_node=2)
    _say(f"[demo] job {job['id']} {job['state']} on {sorted({r['node_id'] for r in job['placement']})}")
    if job["state"] != "running":
        return 1
    time.sleep(1.0)
    victim = job["placement"][0]
    fault = InjectFault(kind=FaultKind.XID, gpu=victim["gpu"], xid=79)
    injected_at = time.time()
    reply = client.inject(fault, node_id=victim["node_id"])
    _say(f"[demo] injected XID 79 on {victim['node_id']} GPU {victim['gpu']}: {reply.detail}")

    incidents = poll(lambda: client.incidents(job["id"]), bool, timeout_s=15)
    recoveries = poll(
        lambda: client.recoveries(job["id"]),
        lambda r: bool(r) and r[0]["step"] in ("running", "failed"),
        timeout_s=60,
    )
    if not incidents or not recoveries:
        _say("[demo] FAILED: no incident or no recovery")
        return 1
    _report(incidents[0], recoveries[0], injected_at, client.latest_checkpoint(job["id"]).status_code)
    ok = recoveries[0]["step"] == "running" and client.job(job["id"])["state"] == "running"
    _say("[demo] RESULT: " + ("recovered without help" if ok else "recovery FAILED"))
    return 0 if ok else 1


def _report(incident: dict[str, Any], recovery: dict[str, Any], injected_at: float, registry_status: int) -> None:
    opened = datetime.fromisoformat(incident["opened_at"]).timestamp()
    culprit = incident.get("culprit") or {
        "node_id": incident.get("culprit_node_id"),
        "gpu": incident.get("culprit_gpu"),
        "rank": incident.get("culprit_rank"),
    }
    _say(
        f"[demo] incident {incident['id']}: {incident['category']} / {incident['root_cause']} "
        f"culprit {culprit} → {incident['recommended_action']} (opened {opened - injected_at:.3f}s after the fault)"
    )
    _say(f"[demo] recovery {recovery['id']} fence {recovery['fence']} ({recovery['step']})")
    _say(f"        {'step':<16} {'seconds':>8}  detail")
    for step in recovery["steps"]:
        took = _seconds(step["started_at"], step["ended_at"])
        detail = _step_detail(step)
        _say(f"        {step['step']:<16} {'' if took is None else f'{took:8.3f}'}  {detail}")
    _say(f"[demo] registry latest-checkpoint query answered HTTP {registry_status}")


def _step_detail(step: dict[str, Any]) -> str:
    data = step.get("data") or {}
    if "answers" in data:
        return ", ".join(f"{a['node']}={a['result']}" for a in data["answers"])
    if "checkpoint" in data:
        return str(data.get("note") or data["checkpoint"])
    return ""
