"""`reprise demo` from start to end: the platform, the scenario, the summary, the picture, and --keep."""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from contextlib import closing
from pathlib import Path
from types import FrameType

from reprise_cli.client import PlatformClient
from reprise_cli.creds import read_api_key_file
from reprise_cli.demo import report, timeline
from reprise_cli.demo.errors import DemoFailure
from reprise_cli.demo.kube_view import KubeView
from reprise_cli.demo.models import DemoRun, demo_faults
from reprise_cli.demo.scenario import Scenario
from reprise_cli.demo.slurm_view import SlurmView
from reprise_cli.demo.training import ReferenceRun, Training
from reprise_cli.stack import Stack
from reprise_cli.topology import StackConfig, slack_receiver_url
from reprise_common.errors import ConfigError

SLURM_STEPS = 160
BENCH_RECOVERY = Path(__file__).resolve().parents[3] / "bench" / "results" / "recovery.json"


class Narrator:
    """Prints one line per event, stamped with the seconds since the demo began."""

    def __init__(self) -> None:
        self.began = time.monotonic()

    def __call__(self, text: str) -> None:
        """Print one line at once."""
        print(f"[{time.monotonic() - self.began:6.1f}s] {text}", flush=True)


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_demo(config: StackConfig, *, keep: bool = False, cold: bool = False) -> int:
    """Run the whole demo; 0 when every fault was recovered and the parameters equal the reference's. `cold`: the job
    restarts cold at every recovery (policy `restart_mode: cold`, the script without --in-place)."""
    # Explicit handlers: a launcher started from a script in the background inherits SIGINT as ignored.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    shutil.rmtree(config.state_dir, ignore_errors=True)  # a demo starts from nothing, whatever ran before
    say = Narrator()
    stack = Stack(config, say=say)
    # On Slurm the agents, and their warm standbys, start with the job's allocation, and the first fault waits until
    # the standbys are ready (Scenario._wait_for_standbys): 40 more steps (two checkpoint intervals) keep room for the
    # four faults after it. The faults, their spacing and what is measured of each are the same.
    # Kubernetes' pods start their agents with the job too.
    steps = SLURM_STEPS if config.scheduler in ("slurm", "kubernetes") else Training.steps
    training = Training(steps=steps, in_place=not cold)
    # The reference trains while the platform starts: both are over before the job is submitted, so no timing of
    # the job or of a recovery shares the CPU with it.
    reference = ReferenceRun(training, world_size=config.nodes, work_dir=config.state_dir.resolve() / "reference")
    code = 1
    try:
        say(f"fault-free reference started: {config.nodes} local gloo ranks without the platform")
        reference.start()
        on = {
            "slurm": " on a local Slurm cluster (jobs in Slurm allocations)",
            "kubernetes": " on a local Kubernetes API server (jobs' agents in pods, a kubelet double runs them)",
        }.get(config.scheduler, "")
        on += ", the ranks in containers (a dockerd of its own)" if config.runtime == "docker" else ""
        say(f"starting the platform{on}: {config.nodes} nodes + {config.spares} spare (logs in {stack.log_dir})")
        stack.start(timeout_s=90)
        say("every service ready")
        with closing(stack.client()) as client:
            code = _run(stack, client, training, reference, say)
            if keep:
                _keep(stack, say)
    except ConfigError as exc:
        print(f"reprise demo: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        say("interrupted")
        code = 130
    finally:
        reference.stop()
        stack.stop()
        say("platform stopped")
    return code


def _run(stack: Stack, client: PlatformClient, training: Training, reference: ReferenceRun, say: Narrator) -> int:
    scenario = Scenario(stack, client, training, say, work_dir=stack.config.state_dir.resolve())
    if stack.container_image is not None:  # the job's directory under the nodes' mount roots, away from the socket
        scenario.image, scenario.work_dir = stack.container_image, stack.config.jobs_dir
        say(f"the job's ranks run in containers of {stack.container_image} (docs/containers.md)")
    faults = demo_faults(stack.config.nodes)
    if stack.slurm is not None:
        scenario.slurm = SlurmView(stack.slurm)
        scenario.slurm.start()
    if stack.kube is not None:
        scenario.kube = KubeView(stack.kube)
    try:
        run = scenario.run(faults, reference=reference)
    except DemoFailure as exc:
        say(f"FAILED: {exc} (logs in {stack.log_dir})")
        return 1
    finally:
        if scenario.slurm is not None:
            scenario.slurm.stop()
    _conclude(run, stack, client, say)
    ok = run.ok and len(run.faults) == len(faults)
    figures = stack.config.state_dir.resolve() / "demo.json"
    numbers = report.figures(run, scheduler=stack.config.scheduler) | {"runtime": stack.config.runtime, "ok": ok}
    figures.write_text(json.dumps(numbers, indent=1))
    say(f"figures: {figures}")
    say("RESULT: " + ("every fault recovered without help; parameters equal" if ok else "FAILED (see above)"))
    return 0 if ok else 1


def _conclude(run: DemoRun, stack: Stack, client: PlatformClient, say: Narrator) -> None:
    """The table, goodput and verdict, the picture, and where the incidents can be seen."""
    report.summary(run, say=say)
    for line in report.bench_comparison(BENCH_RECOVERY):
        say(line)
    picture = timeline.draw(run, stack.config.state_dir.resolve() / "timeline.png")
    say(f"timeline: {picture}")
    job_id = run.job["id"]
    if any(spec.name == "dashboard" for spec in stack.specs):
        say(f"dashboard: {stack.url('dashboard')}/jobs/{job_id} (incidents: {stack.url('dashboard')}/incidents)")
        say(f"  sign in with the key in {read_api_key_file(stack.config.state_dir)}")
    receiver = slack_receiver_url(stack.config)
    counts = report.slack_messages_per_incident(
        client.http, receiver_url=receiver, notifier_url=stack.url("notifier"), job_id=job_id
    )
    say(f"Slack messages: {receiver}/ (JSON: {receiver}/messages), per incident:")
    named = [((f.incident or {}).get("id"), str(f.plan.fault)) for f in run.faults]
    named += [(r.get("incident_id"), "unplanned recovery") for r in run.unplanned]
    for incident_id, what in named:
        if incident_id:
            say(f"  incident {incident_id} ({what}): {counts.get(incident_id, 0)} message(s)")


def _keep(stack: Stack, say: Narrator) -> None:
    say(f"--keep: the platform keeps running (orchestrator {stack.url('orchestrator')}); Ctrl-C stops it")
    try:
        while True:
            signal.pause()
    except KeyboardInterrupt:
        return
