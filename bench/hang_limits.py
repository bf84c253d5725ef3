"""Hang limits without a job's own limit: false alarms over long training, and how soon real hangs are called.

On the local stack (real servers, agents and detector; the simulated GPU backend), `--jobs` copies of the demo's
training script (examples/ddp_train.py, 2 ranks in a gloo group on one node each) train at once with no
`hang_timeout_s`, so the detector's defaults apply (k x the rolling p99 step time, the floor, the phases' own
limits). The script checkpoints every `--checkpoint-every` steps (phase `checkpointing`), evaluates every
`--eval-every` steps for `--eval-s` seconds (phase `eval`), and takes a slow step of 2-5 x its step time every
`--slow-every` steps. Over `--minutes` every incident is a false alarm. Then each job's rank 1 is frozen with
SIGSTOP `--hangs` times in all (one job at a time, after the previous recovery): the time from the freeze to the
incident is the hang detection time of a job without a limit of its own.

With `--no-sdk` the jobs run a script with no Reprise import instead (tests/stepless_job.py: an all_reduce a step,
an evaluation of `--eval-s` on rank 0 while rank 1 waits in a barrier every `--eval-every` steps, slow steps): it
reports no step and no phase, so past `--grace-s` it is timed by its stack samples (docs/detector.md, "Hangs without
the SDK"; `--startup-s` lowers the startup limit a run must outlast). The hangs alternate between a frozen rank 1
(SIGSTOP, caught at the training limit) and a rank 1 blocked in Python while rank 0 waits for it in all_reduce
(caught at `--stepless-s`); each is to be called within its limit + 15 s, naming rank 1.

  training_minutes_in_all  minutes of training the jobs did together during the watch
  false_alarms             incidents opened during the watch (target 0)
  hangs_caught             frozen ranks called hung (target: every one)
  detection_s              freeze → incident opened: median, max, each
  limits                   the detector's defaults the run measured (from its settings)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from contextlib import closing
from datetime import UTC, datetime
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

HANG_WAIT_S = 120.0  # a frozen rank not called hung within this long is a missed hang (or the limit + this)
STEPLESS_SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "stepless_job.py"


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
        "policy": POLICY,
    }


# The same rank frozen five times, with no newer checkpoint in between: the platform's guards against a fault that
# repeats (max_same_error, max_recoveries_without_progress, 3 each) would rightly fail the job at its fourth hang. This
# bench times detection, so it lets every freeze be recovered.
POLICY = {
    "recovery_time_objective_s": 300,
    "backoff_initial_s": 0,
    "max_same_error": 100,
    "max_recoveries_without_progress": 100,
}


def stepless_spec(args: argparse.Namespace, index: int, work: Path) -> dict[str, Any]:
    """One copy of the script without the SDK, steered by files in its control directory (no hang limit of its own)."""
    control = work / f"job-{index}" / "control"
    control.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, str(STEPLESS_SCRIPT),
        "--control", str(control),
        "--step-s", f"{args.step_sleep:g}",
        "--eval-every", str(args.eval_every),
        "--eval-s", f"{args.eval_s:g}",
        "--slow-every", str(args.slow_every),
    ]  # fmt: skip
    return {"name": f"hang-limits-stepless-{index}", "node_count": 1, "ranks_per_node": 2, "command": command,
            "working_dir": str(work), "env": {"OMP_NUM_THREADS": "1"}, "policy": POLICY}  # fmt: skip


def wait_training(control: Path, settle_s: float) -> None:
    """Until both ranks of a script without the SDK took a step (a relaunch imports torch first), and `settle_s`
    more: the startup grace, and two stack samples, so that the fault is timed from a rank already timed by them."""
    poll(lambda: all((control / f"running-{rank}").exists() for rank in (0, 1)), bool, timeout_s=HANG_WAIT_S * 2)
    time.sleep(settle_s)


def blocked_at(control: Path, asked: datetime) -> datetime:
    """When the rank really blocked: the script notes it (`block-1.since`); a rank busy elsewhere when asked (rank 0
    evaluating while it waits in the barrier) blocks only once that is over."""
    try:
        return max(asked, datetime.fromtimestamp(float((control / "block-1.since").read_text()), tz=UTC))
    except (OSError, ValueError):
        return asked


def opened_since(client: PlatformClient, job_id: str, since: datetime) -> list[dict[str, Any]]:
    """The job's incidents opened at or after `since`."""
    return [i for i in client.incidents(job_id) if datetime.fromisoformat(i["opened_at"]) >= since]


def freeze_and_time(
    client: PlatformClient,
    job: dict[str, Any],
    *,
    control: Path | None = None,
    block: bool = False,
    wait_s: float = HANG_WAIT_S,
    settle_s: float = 0.0,
) -> dict[str, Any]:
    """Freeze the job's rank 1 (or, `block`, block it in Python while rank 0 waits in all_reduce, through the
    script's `control` directory) and wait for the hang's incident and its recovery; what was seen."""
    if control is not None:
        wait_training(control, settle_s)
    node = next(r["node_id"] for r in client.job(job["id"])["placement"] if r["rank"] == 1)
    known = {r["id"] for r in client.recoveries(job["id"])}
    frozen_at = utcnow()
    if control is not None and block:
        (control / "block-1").touch()
    else:
        reply = client.inject(InjectFault(kind=FaultKind.RANK_HANG, rank=1, job_id=job["id"]), node_id=node)
        if not reply.accepted:
            return {"job_id": job["id"], "caught": False, "detail": reply.detail}
    found = poll(lambda: opened_since(client, job["id"], frozen_at), bool, timeout_s=wait_s)
    started = blocked_at(control, frozen_at) if control is not None and block else frozen_at
    if control is not None:
        (control / "block-1").unlink(missing_ok=True)  # the relaunched rank must not block again
        (control / "block-1.since").unlink(missing_ok=True)
        for rank in (0, 1):  # the relaunched ranks write them again
            (control / f"running-{rank}").unlink(missing_ok=True)
    if not found:
        return {"job_id": job["id"], "caught": False, "detail": f"no incident within {wait_s:g} s"}
    incident = found[-1]
    detected = (datetime.fromisoformat(incident["opened_at"]) - started).total_seconds()

    def recovered() -> bool:
        fresh = [r for r in client.recoveries(job["id"]) if r["id"] not in known]
        return bool(fresh) and fresh[0]["step"] in ("running", "failed", "held")

    poll(recovered, bool, timeout_s=180)
    return {
        "job_id": job["id"],
        "fault": "blocked in Python" if block else "SIGSTOP",
        "started_after_s": round((started - frozen_at).total_seconds(), 2),  # asked, and busy elsewhere until then
        "caught": incident["category"] == "hang",
        "category": incident["category"],
        "detection_s": round(detected, 2),
        "culprit_rank": incident["culprit_rank"],
        "root_cause": incident["root_cause"],
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--minutes", type=float, default=16.0, help="the watch, for every job at once")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--hangs", type=int, default=10, help="frozen ranks after the watch, in all")
    parser.add_argument("--step-sleep", type=float, default=0.2)
    parser.add_argument("--checkpoint-every", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=700)
    parser.add_argument("--eval-s", type=float, default=75.0)
    parser.add_argument("--slow-every", type=int, default=25)
    parser.add_argument("--no-sdk", action="store_true", help="a script without the SDK (tests/stepless_job.py)")
    defaults = DetectorSettings()
    parser.add_argument("--stepless-s", type=float, default=defaults.hang_stepless_s, help="REPRISE_HANG_STEPLESS_S")
    parser.add_argument("--grace-s", type=float, default=defaults.hang_stepless_grace_s)
    parser.add_argument("--startup-s", type=float, default=defaults.hang_startup_s, help="REPRISE_HANG_STARTUP_S")
    parser.add_argument("--sample-s", type=float, default=10.0, help="REPRISE_STACK_SAMPLE_S (the agents')")
    return parser.parse_args(argv)


def stepless_environment(args: argparse.Namespace) -> None:
    """The services the stack starts read their limits from this process's environment."""
    os.environ["REPRISE_HANG_STEPLESS_S"] = f"{args.stepless_s:g}"
    os.environ["REPRISE_HANG_STEPLESS_GRACE_S"] = f"{args.grace_s:g}"
    os.environ["REPRISE_HANG_STARTUP_S"] = f"{args.startup_s:g}"
    os.environ["REPRISE_STACK_SAMPLE_S"] = f"{args.sample_s:g}"


def run_hangs(client: PlatformClient, jobs: list[dict[str, Any]], args: argparse.Namespace, work: Path) -> list[Any]:
    """The faults, one job at a time: SIGSTOP each time (SDK), or SIGSTOP and a rank blocked in Python in turn."""
    hangs = []
    for n in range(args.hangs):
        index = (n // 2 if args.no_sdk else n) % len(jobs)  # without the SDK, each job gets each fault in turn
        blocked = args.no_sdk and n % 2 == 1
        control = work / f"job-{index}" / "control" if args.no_sdk else None
        wait = args.stepless_s + args.sample_s + HANG_WAIT_S if blocked else HANG_WAIT_S
        settle = args.grace_s + 2 * args.sample_s
        seen = freeze_and_time(client, jobs[index], control=control, block=blocked, wait_s=wait, settle_s=settle)
        limit = args.stepless_s if blocked else DetectorSettings().hang_floor_s
        seen |= {"limit_s": limit, "within_limit_15_s": seen.get("detection_s", math.inf) <= limit + 15}
        hangs.append(seen)
    return hangs


def main(argv: list[str] | None = None) -> int:
    """Train, watch for false alarms, then time the hangs; print and save the figures."""
    args = parse(argv)
    work = Path(tempfile.mkdtemp(prefix="reprise-hang-limits-"))
    if args.no_sdk:
        stepless_environment(args)
    config = StackConfig(
        nodes=args.jobs, spares=0, gpus_per_node=2, state_dir=work / "state",
        ports=free_stack_ports(DEFAULT_PORTS, agents=args.jobs),
    )  # fmt: skip
    stack = Stack(config)
    stack.start(timeout_s=180)
    spec = stepless_spec if args.no_sdk else job_spec
    try:
        with closing(stack.client()) as client:
            poll(client.nodes, lambda n: len(n) == args.jobs, timeout_s=30)
            jobs = [client.submit(spec(args, index, work)) for index in range(args.jobs)]
            began, watch_from = time.monotonic(), utcnow()
            while time.monotonic() - began < args.minutes * 60:
                time.sleep(10)
            watched_s = time.monotonic() - began
            alarms = [i for job in jobs for i in opened_since(client, job["id"], watch_from)]
            hangs = run_hangs(client, jobs, args, work)
    finally:
        stack.stop()
    return report(args, jobs, watched_s, alarms, hangs)


def report(
    args: argparse.Namespace, jobs: list[Any], watched_s: float, alarms: list[Any], hangs: list[dict[str, Any]]
) -> int:
    """Print and save the figures; 0 when there was no false alarm and every hang was caught."""
    defaults = DetectorSettings()
    caught = [h for h in hangs if h["caught"]]
    detection = [h["detection_s"] for h in caught]
    figures = {
        "settings": vars(args),
        "limits": {
            "floor_s": defaults.hang_floor_s,
            "k": defaults.hang_k,
            "checkpointing_s": defaults.hang_checkpointing_s,
            "evaluating_s": defaults.hang_evaluating_s,
            **(
                {"stepless_s": args.stepless_s, "grace_s": args.grace_s, "startup_s": args.startup_s}
                if args.no_sdk
                else {}
            ),
        },
        "training_minutes_in_all": round(watched_s * len(jobs) / 60, 1),
        "false_alarms": len(alarms),
        "false_alarm_causes": [i["root_cause"] for i in alarms],
        "hangs": len(hangs),
        "hangs_caught": len(caught),
        "culprit_named": sum(h.get("culprit_rank") == 1 for h in caught),
        "within_limit_15_s": sum(h["within_limit_15_s"] for h in hangs),
        "detection_s": {
            "median": statistics.median(detection) if detection else None,
            "max": max(detection, default=None),
            "each": detection,
        },
        "hang_runs": hangs,
    }
    path = write_result("hang-limits-no-sdk" if args.no_sdk else "hang-limits", figures)
    print({k: v for k, v in figures.items() if k != "hang_runs"})
    print(f"written to {path}")
    return 0 if not alarms and len(caught) == len(hangs) else 1


if __name__ == "__main__":
    sys.exit(main())
