"""Hang limits without a job's own limit: false alarms over long training, and how soon real hangs are called.

On the local stack (real servers, agents and detector; the simulated GPU backend), `--jobs` copies of the demo's
training script (examples/ddp_train.py, 2 ranks in a gloo group on one node each) train at once with no
`hang_timeout_s`, so the detector's defaults apply (k x the rolling p99 step time, the floor, the phases' own
limits). The script checkpoints every `--checkpoint-every` steps (phase `checkpointing`), evaluates every
`--eval-every` steps for `--eval-s` seconds (phase `eval`), and takes a slow step of 2-5 x its step time every
`--slow-every` steps. Over `--minutes` every incident is a false alarm. Then each job's rank 1 is frozen with
SIGSTOP `--hangs` times in all (one job at a time, after the previous recovery): the time from the freeze to the
incident is the hang detection time of a job without a limit of its own.

  training_minutes_in_all  minutes of training the jobs did together during the watch
  false_alarms             incidents opened during the watch (target 0)
  hangs_caught             frozen ranks called hung (target: every one)
  detection_s              freeze → incident opened: median, max, each
  limits                   the detector's defaults the run measured (from its settings)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import closing
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import write_result
from reprise_cli.client import PlatformClient, poll
from reprise_cli.demo.training import example_script
from reprise_cli.servers import free_stack_ports
from reprise_cli.stack import Stack
from reprise_cli.topology import DEFAULT_PORTS, StackConfig
from reprise_common.clock import utcnow
from reprise_common.events import FaultKind, InjectFault
from reprise_detector.settings import DetectorSettings

HANG_WAIT_S = 120.0  # a frozen rank not called hung within this long is a missed hang


def job_spec(args: argparse.Namespace, index: int, work: Path) -> dict[str, Any]:
    """One copy of the training script, long enough for the watch and the hangs, with no hang limit of its own."""
    steps = int((args.minutes * 60 + args.hangs * 60) / args.step_sleep) + 1000
    checkpoints = work / f"job-{index}" / "checkpoints"
    command = [
        sys.executable, str(example_script()),
        "--steps", str(steps),
        "--checkpoint-every", str(args.checkpoint_every),
        "--checkpoint-dir", str(checkpoints),
        "--step-sleep", f"{args.step_sleep:g}",
        "--eval-every", str(args.eval_every),
        "--eval-s", f"{args.eval_s:g}",
        "--slow-every", str(args.slow_every),
        "--slow-max", "5",
        "--seed", str(index),
    ]  # fmt: skip
    return {
        "name": f"hang-limits-{index}",
        "node_count": 1,
        "ranks_per_node": 2,
        "command": command,
        "working_dir": str(work),
        "checkpoint_dir": str(checkpoints),
        # The same rank frozen five times, with no newer checkpoint in between: the platform's guards against a
        # fault that repeats (max_same_error, max_recoveries_without_progress, 3 each) would rightly fail the job
        # at its fourth hang. This bench times detection, so it lets every freeze be recovered.
        "policy": {
            "recovery_time_objective_s": 300,
            "backoff_initial_s": 0,
            "max_same_error": 100,
            "max_recoveries_without_progress": 100,
        },
    }


def opened_since(client: PlatformClient, job_id: str, since: datetime) -> list[dict[str, Any]]:
    """The job's incidents opened at or after `since`."""
    return [i for i in client.incidents(job_id) if datetime.fromisoformat(i["opened_at"]) >= since]


def freeze_and_time(client: PlatformClient, job: dict[str, Any]) -> dict[str, Any]:
    """Freeze the job's rank 1 and wait for the hang's incident and its recovery; what was seen."""
    node = next(r["node_id"] for r in job["placement"] if r["rank"] == 1)
    known = {r["id"] for r in client.recoveries(job["id"])}
    frozen_at = utcnow()
    reply = client.inject(InjectFault(kind=FaultKind.RANK_HANG, rank=1, job_id=job["id"]), node_id=node)
    if not reply.accepted:
        return {"job_id": job["id"], "caught": False, "detail": reply.detail}
    found = poll(lambda: opened_since(client, job["id"], frozen_at), bool, timeout_s=HANG_WAIT_S)
    if not found:
        return {"job_id": job["id"], "caught": False, "detail": f"no incident within {HANG_WAIT_S:g} s"}
    incident = found[-1]
    detected = (datetime.fromisoformat(incident["opened_at"]) - frozen_at).total_seconds()

    def recovered() -> bool:
        fresh = [r for r in client.recoveries(job["id"]) if r["id"] not in known]
        return bool(fresh) and fresh[0]["step"] in ("running", "failed", "held")

    poll(recovered, bool, timeout_s=180)
    return {
        "job_id": job["id"],
        "caught": incident["category"] == "hang",
        "category": incident["category"],
        "detection_s": round(detected, 2),
        "culprit_rank": incident["culprit_rank"],
        "root_cause": incident["root_cause"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=16.0, help="the watch, for every job at once")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--hangs", type=int, default=10, help="frozen ranks after the watch, in all")
    parser.add_argument("--step-sleep", type=float, default=0.2)
    parser.add_argument("--checkpoint-every", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=700)
    parser.add_argument("--eval-s", type=float, default=75.0)
    parser.add_argument("--slow-every", type=int, default=25)
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="reprise-hang-limits-"))
    config = StackConfig(
        nodes=args.jobs, spares=0, gpus_per_node=2, state_dir=work / "state",
        ports=free_stack_ports(DEFAULT_PORTS, agents=args.jobs),
    )  # fmt: skip
    stack = Stack(config)
    stack.start(timeout_s=180)
    defaults = DetectorSettings()
    try:
        with closing(stack.client()) as client:
            poll(client.nodes, lambda n: len(n) == args.jobs, timeout_s=30)
            jobs = [client.submit(job_spec(args, index, work)) for index in range(args.jobs)]
            began, watch_from = time.monotonic(), utcnow()
            while time.monotonic() - began < args.minutes * 60:
                time.sleep(10)
            watched_s = time.monotonic() - began
            alarms = [i for job in jobs for i in opened_since(client, job["id"], watch_from)]
            hangs = [freeze_and_time(client, jobs[n % len(jobs)]) for n in range(args.hangs)]
    finally:
        stack.stop()
    caught = [h for h in hangs if h["caught"]]
    detection = [h["detection_s"] for h in caught]
    figures = {
        "settings": vars(args),
        "limits": {
            "floor_s": defaults.hang_floor_s,
            "k": defaults.hang_k,
            "checkpointing_s": defaults.hang_checkpointing_s,
            "evaluating_s": defaults.hang_evaluating_s,
        },
        "training_minutes_in_all": round(watched_s * len(jobs) / 60, 1),
        "false_alarms": len(alarms),
        "false_alarm_causes": [i["root_cause"] for i in alarms],
        "hangs": len(hangs),
        "hangs_caught": len(caught),
        "detection_s": {
            "median": statistics.median(detection) if detection else None,
            "max": max(detection, default=None),
            "each": detection,
        },
        "hang_runs": hangs,
    }
    path = write_result("hang-limits", figures)
    print({k: v for k, v in figures.items() if k != "hang_runs"})
    print(f"written to {path}")
    return 0 if not alarms and len(caught) == len(hangs) else 1


if __name__ == "__main__":
    sys.exit(main())
