"""`reprise job submit|list|show|cancel`: jobs through the orchestrator's REST API.

Where the API is and which key to send: --api-url / --api-key, else REPRISE_API_URL / REPRISE_API_KEY, else the
local stack's orchestrator port and the admin key in its state dir (--state-dir, default .state).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from reprise_cli.client import LOCAL_HOST, PlatformClient, poll, step_seconds
from reprise_cli.creds import read_admin_api_key
from reprise_cli.topology import DEFAULT_PORTS

EXIT_REFUSED = 1  # the API answered with an error
EXIT_USAGE = 2  # nothing was asked: an unreadable file, an unreachable API


class JobFileError(Exception):
    """A job file that cannot be read as a mapping of POST /v1/jobs fields."""


@dataclass(frozen=True)
class ApiTarget:
    """Where the orchestrator's API is and the key to send it."""

    url: str
    api_key: str | None


def resolve_target(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ApiTarget:
    """Flags first, then REPRISE_API_URL / REPRISE_API_KEY, then the local stack's defaults."""
    env = os.environ if environ is None else environ
    url = args.api_url or env.get("REPRISE_API_URL") or f"http://{LOCAL_HOST}:{DEFAULT_PORTS['orchestrator']}"
    key = args.api_key or env.get("REPRISE_API_KEY") or read_admin_api_key(Path(args.state_dir))
    return ApiTarget(url=url.rstrip("/"), api_key=key)


def load_job_file(path: Path) -> dict[str, Any]:
    """The job spec in a YAML file; the API validates its fields."""
    try:
        spec = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise JobFileError(f"cannot read {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise JobFileError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(spec, dict):
        raise JobFileError(f"{path} must be a mapping of job fields (name, node_count or nodes, command, ...)")
    return spec


def _location(loc: list[Any]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or "(the job as a whole)"


def describe_error(response: httpx.Response) -> str:
    """An error answer in words: every field error of a 422 on its own line, a hint for 401."""
    try:
        detail: Any = response.json().get("detail")
    except ValueError:
        detail = response.text[:300]
    if response.status_code == 422 and isinstance(detail, list):
        lines = [f"  {_location(err.get('loc', []))}: {err.get('msg', err)}" for err in detail]
        return "the API refused the job spec (HTTP 422):\n" + "\n".join(lines)
    if response.status_code == 401:
        return f"{detail} (HTTP 401): pass --api-key, set REPRISE_API_KEY, or point --state-dir at the local stack"
    return f"{detail} (HTTP {response.status_code})"


def _run(args: argparse.Namespace, action: Callable[[PlatformClient], int]) -> int:
    target = resolve_target(args)
    client = PlatformClient(orchestrator=target.url, api_key=target.api_key)
    try:
        return action(client)
    except httpx.HTTPStatusError as exc:
        print(f"reprise job {args.action}: {describe_error(exc.response)}", file=sys.stderr)
        return EXIT_REFUSED
    except httpx.HTTPError as exc:
        print(
            f"reprise job {args.action}: cannot reach the orchestrator at {target.url} ({exc}); "
            "is `reprise up` running, or is --api-url / REPRISE_API_URL wrong?",
            file=sys.stderr,
        )
        return EXIT_USAGE
    finally:
        client.close()


def _nodes(job: dict[str, Any]) -> str:
    return ", ".join(dict.fromkeys(str(r["node_id"]) for r in job.get("placement", []))) or "-"


def cmd_submit(args: argparse.Namespace) -> int:
    """Submit the job described in a YAML file."""
    try:
        spec = load_job_file(Path(args.file))
    except JobFileError as exc:
        print(f"reprise job submit: {exc}", file=sys.stderr)
        return EXIT_USAGE

    def submit(client: PlatformClient) -> int:
        job = client.submit(spec)
        ranks = len(job.get("placement", []))
        print(f"job {job['id']} {job['state']} on {_nodes(job)} ({ranks} ranks)")
        return 0 if job["state"] != "failed" else EXIT_REFUSED

    return _run(args, submit)


def cmd_list(args: argparse.Namespace) -> int:
    """Jobs, newest first."""

    def show(client: PlatformClient) -> int:
        jobs = client.jobs(state=args.state, labels=args.label, limit=args.limit)
        if not jobs:
            print("no jobs" + (f" in state {args.state}" if args.state else "") + _labelled(args.label))
            return 0
        print(f"{'ID':<18} {'NAME':<24} {'STATE':<11} {'RESTARTS':>8}  {'CREATED':<20} NODES")
        for job in jobs:
            created = str(job["created_at"])[:19].replace("T", " ")
            print(
                f"{job['id']:<18} {job['name'][:24]:<24} {job['state']:<11} {job['restarts']:>8}  {created:<20} "
                f"{_nodes(job)}"
            )
        return 0

    return _run(args, show)


def _labelled(selectors: list[str]) -> str:
    return f" labelled {', '.join(selectors)}" if selectors else ""


def _labels_line(labels: dict[str, str]) -> str:
    """A job's labels as `key=value` pairs sorted by key, or "-" when it has none."""
    return " ".join(f"{key}={value}" for key, value in sorted(labels.items())) or "-"


def _print_recovery(recovery: dict[str, Any]) -> None:
    outcome = f", {recovery['outcome']}" if recovery.get("outcome") else ""
    print(f"  recovery {recovery['id']}  {recovery['step']}{outcome}  fence {recovery['fence']}")
    print(f"    started {recovery['started_at']}  incident {recovery.get('incident_id') or '-'}")
    if recovery.get("detail"):
        print(f"    detail  {recovery['detail']}")
    print(f"    {'step':<16} {'seconds':>9}")
    for step in recovery["steps"]:
        took = step_seconds(step)
        print(f"    {step['step']:<16} {'running' if took is None else f'{took:.3f}':>9}")


def cmd_show(args: argparse.Namespace) -> int:
    """One job and its recoveries, each step with how long it took."""

    def show(client: PlatformClient) -> int:
        job = client.job(args.job_id)
        recoveries = client.recoveries(args.job_id)
        print(f"job {job['id']}  {job['name']}  {job['state']}")
        if job.get("detail"):
            print(f"  detail     {job['detail']}")
        print(f"  labels     {_labels_line(job.get('labels') or {})}")
        print(f"  restarts   {job['restarts']} (restart epoch {job['restart_epoch']})")
        print(f"  created    {job['created_at']}   updated {job['updated_at']}")
        for rank in job.get("placement", []):
            gpu = "-" if rank.get("gpu") is None else rank["gpu"]
            print(f"  rank {rank['rank']:<5} {rank['node_id']}  gpu {gpu}")
        print(f"recoveries: {len(recoveries) or 'none'}")
        for recovery in recoveries:
            _print_recovery(recovery)
        return 0

    return _run(args, show)


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel a job (its ranks are stopped)."""

    def cancel(client: PlatformClient) -> int:
        job = client.cancel(args.job_id)
        print(f"job {job['id']} {job['state']}")
        return 0

    return _run(args, cancel)


def cmd_drill(args: argparse.Namespace) -> int:
    """Inject a fault into a running job and report whether its recovery met the policy's time objective."""

    def drill(client: PlatformClient) -> int:
        started = client.start_drill(args.job, fault=args.fault, rank=args.rank)
        print(f"drill {started['id']}: {started['detail']} on {started['node_id']}; waiting for the recovery ...")
        done = poll(lambda: client.drill(started["id"]), lambda d: d["state"] != "running", timeout_s=args.timeout)
        print(
            f"drill {done['id']} {done['state']}: detection {done['detection_s']} s, recovery {done['recovery_s']} s "
            f"(objective {done['objective_s']:g} s) — {done['detail']}"
        )
        return 0 if done["state"] == "passed" else EXIT_REFUSED

    return _run(args, drill)


def _api_flags() -> argparse.ArgumentParser:
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--api-url", default=None, help="the orchestrator (else REPRISE_API_URL, else the local stack)")
    flags.add_argument(
        "--api-key", default=None, help="an API key (prefer REPRISE_API_KEY: flags show in `ps`; else the state dir's)"
    )
    flags.add_argument("--state-dir", default=".state", help="the local stack whose admin key to use")
    return flags


def add_job_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `reprise job ...` to the command line's subcommands."""
    job = sub.add_parser("job", help="submit, list, show and cancel jobs through the orchestrator's API")
    actions = job.add_subparsers(dest="action", required=True)
    flags = _api_flags()

    submit = actions.add_parser("submit", parents=[flags], help="submit a job described in a YAML file")
    submit.add_argument("file", help="YAML with the fields of POST /v1/jobs (see examples/jobs/ticker.yaml)")
    submit.set_defaults(func=cmd_submit)

    listing = actions.add_parser("list", parents=[flags], help="jobs, newest first")
    listing.add_argument("--state", default=None, help="only jobs in this state (running, failed, cancelled, ...)")
    listing.add_argument(
        "--label", action="append", default=[], metavar="KEY=VALUE", help="only jobs with this label (repeatable: all)"
    )
    listing.add_argument("--limit", type=int, default=100)
    listing.set_defaults(func=cmd_list)

    show = actions.add_parser("show", parents=[flags], help="a job and its recoveries with step durations")
    show.add_argument("job_id")
    show.set_defaults(func=cmd_show)

    cancel = actions.add_parser("cancel", parents=[flags], help="cancel a job")
    cancel.add_argument("job_id")
    cancel.set_defaults(func=cmd_cancel)


def add_drill_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `reprise drill --job ID --fault F` to the command line's subcommands."""
    drill = sub.add_parser("drill", parents=[_api_flags()], help="inject a fault into a running job, time its recovery")
    drill.add_argument("--job", required=True, help="a running job's id")
    drill.add_argument("--fault", required=True, choices=["kill-rank", "xid79", "hang", "node-loss"])
    drill.add_argument("--rank", type=int, default=None, help="the rank to hit (default: the job's last)")
    drill.add_argument("--timeout", type=float, default=600.0, help="how long to wait for the verdict (s)")
    drill.set_defaults(func=cmd_drill, action="drill")
