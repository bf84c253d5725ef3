"""The demo's numbers: per-fault detection, recovery and recomputation, the run's goodput, Slack messages.

Definitions (docs/demo.md):
- detection latency: fault injected → the detector opened the incident (its `opened_at`);
- recovery time: fault injected → training progressing again, i.e. the end of the recovery's `verifying` step (every
  rank of the new launch reported a step past the restored checkpoint's);
- steps recomputed: the last step rank 0 completed before the fault stopped training minus the step training went on
  from (a surviving peer's state, said by the ranks, or else the restored checkpoint's);
- time lost: fault injected → rank 0 back at the step where the fault hit (recovery plus recomputation);
- goodput: the time in which rank 0 went past the furthest step it had reached ÷ the training wall time (rank 0's
  first step to its last): the share of the run spent making new progress.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from reprise_cli.client import step_seconds
from reprise_cli.demo.models import DemoRun, FaultRun
from reprise_cli.demo.sampler import Sample, last_step, reached


@dataclass(frozen=True)
class FaultNumbers:
    """What one fault cost."""

    detection_s: float | None
    recovery_s: float | None
    step_at_fault: int | None
    restored_step: int | None
    lost_s: float | None

    @property
    def recomputed(self) -> int | None:
        """Steps trained again: from the restored checkpoint to where the fault hit."""
        if self.step_at_fault is None or self.restored_step is None:
            return None
        return max(0, self.step_at_fault - self.restored_step)


def _seconds(fault: FaultRun, at: str | None) -> float | None:
    return None if at is None else (datetime.fromisoformat(at) - fault.injected_at).total_seconds()


def fault_numbers(fault: FaultRun, samples: list[Sample]) -> FaultNumbers:
    """Detection, recovery, recomputation and time lost for one fault."""
    verifying = fault.step("verifying") if fault.recovered else None
    step_at_fault = last_step(samples, epoch=fault.epoch)
    back = None
    if step_at_fault is not None and fault.recovered:
        back = reached(samples, step=step_at_fault, after=fault.injected_at, epoch=fault.epoch + 1)
    return FaultNumbers(
        detection_s=_seconds(fault, (fault.incident or {}).get("opened_at")),
        recovery_s=_seconds(fault, (verifying or {}).get("ended_at")),
        step_at_fault=step_at_fault,
        restored_step=fault.restored_step,
        lost_s=None if back is None else (back - fault.injected_at).total_seconds(),
    )


@dataclass(frozen=True)
class Goodput:
    """The share of the training wall time spent making new progress."""

    wall_s: float
    progress_s: float

    @property
    def ratio(self) -> float:
        """Progress time over wall time."""
        return self.progress_s / self.wall_s if self.wall_s > 0 else 0.0


def goodput(samples: list[Sample], *, final_step: int) -> Goodput | None:
    """From rank 0's first step to its last, the time in which it went past the furthest step reached before.

    Between two samples the time counts as progress when the later one stands past every earlier step: re-training
    steps after a restore, and a recovery's downtime, do not count. None when training did not start or finish.
    """
    stepped = [s for s in samples if s.step is not None]
    end = next((i for i, s in enumerate(stepped) if s.step is not None and s.step >= final_step), None)
    if not stepped or end is None:
        return None
    furthest, progress = stepped[0].step or 0, 0.0
    for before, after in itertools.pairwise(stepped[: end + 1]):
        if (after.step or 0) > furthest:
            progress += (after.at - before.at).total_seconds()
            furthest = after.step or 0
    return Goodput(wall_s=(stepped[end].at - stepped[0].at).total_seconds(), progress_s=progress)


def _cell(value: float | int | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def table(run: DemoRun) -> list[str]:
    """The per-fault table, as lines; RTO says whether the recovery met the job's recovery time objective."""
    objective_s = float(run.job["spec"]["policy"]["recovery_time_objective_s"])
    header = (
        f"{'#':<2} {'fault':<11} {'hit':<16} {'detect s':>8} {'recover s':>9} {'RTO':>4} "
        f"{'at step':>7} {'restored':>8} {'recomputed':>10} {'lost s':>7}  outcome"
    )
    lines = [header, "-" * len(header)]
    for index, fault in enumerate(run.faults, start=1):
        n = fault_numbers(fault, run.samples)
        met = "—" if n.recovery_s is None else ("yes" if n.recovery_s <= objective_s else "no")
        hit = f"{fault.node_id} r{fault.plan.rank}"
        outcome = (fault.recovery or {}).get("outcome") or "no recovery"
        lines.append(
            f"{index:<2} {fault.plan.fault:<11} {hit:<16} {_cell(n.detection_s, '8.2f')} "
            f"{_cell(n.recovery_s, '9.2f')} {met:>4} {_cell(n.step_at_fault, '7d')} {_cell(n.restored_step, '8d')} "
            f"{_cell(n.recomputed, '10d')} {_cell(n.lost_s, '7.2f')}  {outcome}{_placement_note(fault)}"
        )
    return lines


def _placement_note(fault: FaultRun) -> str:
    placing = (fault.step("placing") or {}).get("data") or {}
    isolating = (fault.step("isolating") or {}).get("data") or {}
    notes = []
    if isolating.get("cordoned"):
        notes.append(f"cordoned {isolating['cordoned']}")
    if placing.get("decision") == "spares":
        notes.append("spare " + ", ".join(f"{b} for {a}" for a, b in placing.get("replaced", {}).items()))
    elif placing.get("decision") == "shrink":
        notes.append(f"shrunk to {len(placing.get('nodes', []))} nodes")
    return f" ({'; '.join(notes)})" if notes else ""


def slack_messages_per_incident(
    http: httpx.Client, *, receiver_url: str, notifier_url: str, job_id: str, wait_s: float = 15.0
) -> dict[str, int]:
    """Messages the Slack receiver accepted that carry an alert about each incident (once the outbox is empty)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and _pending(http, notifier_url) > 0:
        time.sleep(0.25)
    deliveries = http.get(f"{notifier_url}/v1/deliveries", params={"job_id": job_id, "limit": 1000}).json()["data"]
    incident_of = {d["id"]: d.get("incident_id") for d in deliveries}
    counts: dict[str, int] = {}
    for message in http.get(f"{receiver_url}/messages").json():
        if message.get("status") != 200:
            continue
        incidents = {incident_of.get(block_id) for block_id in _block_ids(message)} - {None}
        for incident_id in incidents:
            counts[str(incident_id)] = counts.get(str(incident_id), 0) + 1
    return counts


def _pending(http: httpx.Client, notifier_url: str) -> int:
    try:
        destinations = http.get(f"{notifier_url}/v1/destinations").json()["data"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0
    return sum(int(d.get("pending") or 0) for d in destinations)


def _block_ids(message: dict[str, Any]) -> list[str]:
    try:
        payload = json.loads(message.get("body") or "")
    except ValueError:
        return []
    blocks = payload.get("blocks", []) if isinstance(payload, dict) else []
    return [str(b["block_id"]) for b in blocks if isinstance(b, dict) and "block_id" in b]


def durations(fault: FaultRun) -> dict[str, float]:
    """How long each step of the fault's recovery took (a retried step: its last record)."""
    steps = ((record["step"], step_seconds(record)) for record in (fault.recovery or {}).get("steps", []))
    return {step: round(took, 3) for step, took in steps if took is not None}


def figures(run: DemoRun, *, scheduler: str) -> dict[str, Any]:
    """The run's numbers as JSON (the demo writes them to <state dir>/demo.json; bench-slurm compares two runs)."""
    result = goodput(run.samples, final_step=run.training.steps)
    faults = []
    for fault in run.faults:
        n = fault_numbers(fault, run.samples)
        faults.append(
            {
                "fault": str(fault.plan.fault),
                "node": fault.node_id,
                "detection_s": n.detection_s,
                "recovery_s": n.recovery_s,
                "restored_step": n.restored_step,
                "recomputed_steps": n.recomputed,
                "lost_s": n.lost_s,
                "outcome": (fault.recovery or {}).get("outcome"),
                "steps_s": durations(fault),
                "restart_mode": ((fault.step("stopping_ranks") or {}).get("data") or {}).get("restart_mode"),
                "placement": _placement_note(fault).strip(" ()"),
                "slurm": fault.slurm,
                "kubernetes": fault.kubernetes,
            }
        )
    return {
        "scheduler": scheduler,
        "ok": run.ok and len(run.faults) > 0,
        "params_equal": run.params_equal,
        "goodput": round(result.ratio, 4) if result is not None else None,
        "start_s": (run.running_at - run.submitted_at).total_seconds() if run.running_at else None,
        "faults": faults,
        "unplanned_recoveries": len(run.unplanned),
    }


def summary(run: DemoRun, *, say: Callable[[str], None]) -> None:
    """Print the table, the goodput and the parameters' verdict."""
    for line in table(run):
        say(line)
    result = goodput(run.samples, final_step=run.training.steps)
    if result is not None:
        say(
            f"goodput {result.ratio:.1%}: {result.progress_s:.1f} s of new progress in {result.wall_s:.1f} s of "
            "training (rank 0's first step to its last; downtime and re-trained steps are not progress)"
        )
    for recovery in run.unplanned:
        say(f"unplanned recovery {recovery['id']}: {recovery.get('outcome')}: {recovery.get('detail', '')}")
    verdict = "EQUAL" if run.params_equal else "DIFFERENT"
    say(f"final parameters {verdict} to the fault-free reference: job {run.digest} vs reference {run.reference.digest}")


BENCH_FAULTS = (("rank_crash", "rank crash"), ("xid79", "XID 79"), ("hang", "hang"), ("node_loss", "node loss"))
BENCH_SYSTEMS = (("fast", "fast path"), ("cold", "cold"))


def bench_comparison(path: Path) -> list[str]:
    """Both paths side by side as `make bench-recovery` last measured them (the same script through the same four
    faults, 5 of each), read from its saved figures; nothing when there are none."""
    try:
        saved = json.loads(path.read_text())
        cells, date = saved["figures"]["cells"], saved["machine"]["date"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    when = date[:16].replace("T", " ")
    lines = [f"both paths, fault -> training again (median of 5), from make bench-recovery of {when} UTC:"]
    for system, name in BENCH_SYSTEMS:
        medians = []
        for fault, label in BENCH_FAULTS:
            median = (cells.get(system, {}).get(fault) or {}).get("time_to_progress_s_median")
            medians.append(f"{label} {median:.2f} s" if isinstance(median, int | float) else f"{label} -")
        lines.append(f"  {name:<9} " + ", ".join(medians))
    return lines
