"""One line per event: the incident a fault opened and each recovery step as it ends."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from reprise_cli.client import step_seconds
from reprise_cli.demo.models import TERMINAL, FaultRun


def nodes_of(job: dict[str, Any]) -> list[str]:
    """The job's nodes in rank order."""
    return list(dict.fromkeys(r["node_id"] for r in sorted(job["placement"], key=lambda r: r["rank"])))


def _since(fault: FaultRun, at: str | None) -> str:
    if at is None:
        return "?"
    return f"+{(datetime.fromisoformat(at) - fault.injected_at).total_seconds():.2f} s"


def incident_line(fault: FaultRun) -> str:
    """The incident a fault opened, in one line."""
    incident = fault.incident or {}
    culprit = f"node {incident.get('culprit_node_id')} rank {incident.get('culprit_rank')}"
    return (
        f"incident opened {_since(fault, incident.get('opened_at'))}: {incident.get('category')} — "
        f"{incident.get('root_cause')} (culprit {culprit}; action {incident.get('recommended_action')})"
    )


def step_lines(recovery: dict[str, Any], origin: datetime, printed: set[tuple[int, str]]) -> list[str]:
    """A line for each recovery step that ended since the last call (`printed` remembers them)."""
    lines = []
    for step in recovery.get("steps", []):
        key = (int(step.get("attempt") or 1), step["step"])
        if key in printed or (step.get("ended_at") is None and step["step"] not in TERMINAL):
            continue
        printed.add(key)
        took = step_seconds(step)
        duration = "" if took is None else f"{took:.2f} s"
        ended = step.get("ended_at") or step["started_at"]
        since = (datetime.fromisoformat(ended) - origin).total_seconds()
        lines.append(f"  recovery {step['step']:<15}{duration:>8} (ended +{since:.2f} s){step_detail(step)}")
    return lines


def _stopping(data: dict[str, Any]) -> str:
    stacks = "; the ranks' Python stacks captured first (a hang)" if data.get("stacks_for") else ""
    if data.get("restart_mode") == "in_place":
        return f": restart in place, {data.get('parked', 0)} rank(s) parked with their processes{stacks}"
    if data.get("restart_mode") == "cold":
        return f": cold restart ({data.get('why', '')}){stacks}"
    return f":{stacks[1:]}" if stacks else ""


def _isolating(data: dict[str, Any]) -> str:
    if data.get("cordoned"):
        return f": cordoned {data['cordoned']}"
    return f": left out {', '.join(data['excluded'])}" if data.get("excluded") else ""


def _placing(data: dict[str, Any]) -> str:
    if "decision" not in data:
        return ""
    moved = ", ".join(f"{a}→{b}" for a, b in (data.get("replaced") or {}).items())
    dropped = ", ".join(data.get("dropped") or [])
    extra = f" {moved}" if moved else f" without {dropped}" if dropped else ""
    return f": {data['decision']}{extra} (world size {data.get('world_size')})"


def _restoring(data: dict[str, Any]) -> str:
    checkpoint = data.get("checkpoint")
    chosen = f": checkpoint step {checkpoint['step']}" if checkpoint else ": no checkpoint, from the start"
    skipped = [f"step {s['step']} ({s['reason'].split(':')[0]})" for s in data.get("skipped") or []]
    return chosen + (f", skipped as corrupt: {', '.join(skipped)}" if skipped else "")


def _launching(data: dict[str, Any]) -> str:
    if "restart_epoch" not in data:
        return ""
    return f": restart epoch {data['restart_epoch']}, rendezvous port {data.get('master_port')}"


def _verifying(data: dict[str, Any]) -> str:
    if data.get("load_failed") is not None:
        return f": ranks {data.get('dead_ranks')} died before their first step: the checkpoint failed to load"
    if data.get("dead_ranks") or data.get("missing"):
        return f": not every rank reached step {data.get('target_step')}"
    return f": every rank at or past step {data.get('target_step')}" if "steps" in data else ""


_DETAILS: dict[str, Callable[[dict[str, Any]], str]] = {
    "stopping_ranks": _stopping,
    "isolating": _isolating,
    "placing": _placing,
    "restoring": _restoring,
    "launching": _launching,
    "verifying": _verifying,
}


def step_detail(step: dict[str, Any]) -> str:
    """What a recovery step decided, in a few words."""
    describe = _DETAILS.get(step["step"])
    return describe(step.get("data") or {}) if describe else ""
