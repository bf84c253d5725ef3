"""The `reprise` command."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from types import FrameType

from reprise_cli.creds import admin_api_key_file, init_credentials, read_api_key_file
from reprise_cli.jobs_cli import add_drill_command, add_job_commands
from reprise_cli.servers import deploy_dir
from reprise_cli.stack import Stack
from reprise_cli.topology import DEFAULT_PORTS, StackConfig, slack_receiver_url
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.errors import BusError, ConfigError
from reprise_common.events import FaultKind, InjectFault, InjectReply


def _stack_config(args: argparse.Namespace) -> StackConfig:
    ports = dict(DEFAULT_PORTS)
    for key, attr in (
        ("nats", "nats_port"),
        ("nats-monitor", "nats_monitor_port"),
        ("redis", "redis_port"),
        ("checkpoint-registry", "registry_port"),
        ("detector", "detector_port"),
        ("orchestrator", "orchestrator_port"),
        ("notifier", "notifier_port"),
        ("slack-receiver", "slack_receiver_port"),
        ("dashboard", "dashboard_port"),
        ("agent", "agent_port"),
    ):
        value = getattr(args, attr, None)
        if value is not None:
            ports[key] = value
    return StackConfig(
        nodes=args.nodes,
        spares=args.spares,
        gpus_per_node=args.gpus_per_node,
        standbys=args.standbys,
        state_dir=Path(args.state_dir),
        ports=ports,
        scheduler=args.scheduler,
        runtime=args.runtime,
    )


def _add_stack_flags(
    parser: argparse.ArgumentParser, *, nodes: int, spares: int, standbys: int = 0, state_dir: str = ".state"
) -> None:
    parser.add_argument("--nodes", type=int, default=nodes, help="simulated worker nodes")
    parser.add_argument("--spares", type=int, default=spares, help="simulated spare nodes")
    parser.add_argument(
        "--standbys", type=int, default=standbys, help="warm standby interpreters per node (torch imported)"
    )
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument(
        "--scheduler",
        choices=["agents", "slurm", "kubernetes"],
        default="agents",
        help="agents: the stack runs an agent per node; slurm: a local Slurm cluster runs the jobs (docs/slurm.md); "
        "kubernetes: a local API server and kubelet double run them, agents in pods (docs/kubernetes.md)",
    )
    parser.add_argument(
        "--runtime",
        choices=["process", "docker"],
        default="process",
        help="docker: a dockerd of the stack's own runs the ranks of jobs with a container image (docs/containers.md)",
    )
    parser.add_argument("--state-dir", default=state_dir, help="logs, SQLite files, NATS store, Redis data")
    flags = ("nats", "nats-monitor", "redis", "registry", "detector", "orchestrator", "notifier", "slack-receiver")
    for flag in (*flags, "dashboard", "agent"):
        parser.add_argument(f"--{flag}-port", type=int, default=None, help="override the default port")


class _Stop(Exception):
    pass


def _raise_stop(signum: int, _frame: FrameType | None) -> None:
    raise _Stop


def cmd_up(args: argparse.Namespace) -> int:
    """Run the local stack until Ctrl-C."""
    stack = Stack(_stack_config(args))
    # Explicit handlers: a launcher started from a script in the background inherits SIGINT as ignored.
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    try:
        print(f"starting Reprise: {args.nodes} nodes + {args.spares} spares (logs in {stack.log_dir})", flush=True)
        stack.start(timeout_s=args.timeout)
        print(
            f"  nats          {stack.config.nats_url}  (monitor http://127.0.0.1:{stack.config.ports['nats-monitor']})"
        )
        print(f"  redis         {stack.config.redis_url}")
        if stack.docker is not None:
            print(f"  dockerd       {stack.config.docker_url}  (image {stack.container_image})")
        if stack.kube is not None and stack.kube.server is not None:
            print(f"  kube-apiserver {stack.kube.server.url}  (kubectl --kubeconfig {stack.kube.kubeconfig})")
        receiver = slack_receiver_url(stack.config)
        print(f"  slack-receiver       {receiver}  (the notifier's Slack messages: {receiver}/ and /messages)")
        for spec in stack.specs:
            print(f"  {spec.name:<20} {stack.url(spec.name)}  (/healthz /readyz /metrics)")
        print(f"  admin API key {admin_api_key_file(stack.config.state_dir)}  (`reprise job ...` uses it)")
        print(
            f"  open the dashboard in a browser: {stack.url('dashboard')}  "
            f"(sign in with the key in {read_api_key_file(stack.config.state_dir)})"
        )
        print("ready. Ctrl-C stops everything.", flush=True)
        while True:
            signal.pause()
    except (KeyboardInterrupt, _Stop):
        print("\nstopping...", flush=True)
        return 0
    except ConfigError as exc:
        print(f"reprise up: {exc}", file=sys.stderr)
        return 2
    finally:
        stack.stop()
        print("stopped.", flush=True)


async def _inject(args: argparse.Namespace) -> InjectReply:
    seed = Path(args.creds) if args.creds else None
    bus = Bus(url=args.nats_url, service="reprise-cli", nkey_seed_file=seed if seed and seed.exists() else None)
    await bus.connect(attempts=3)
    try:
        fault = InjectFault(kind=FaultKind(args.kind), gpu=args.gpu, xid=args.xid)
        return await bus.request(subjects.node_inject(args.node), fault, InjectReply, timeout=5.0)
    finally:
        await bus.close()


def cmd_inject(args: argparse.Namespace) -> int:
    """Inject a simulated GPU fault into one node."""
    try:
        reply = asyncio.run(_inject(args))
    except (BusError, ValueError) as exc:
        print(f"reprise inject: {exc}", file=sys.stderr)
        return 2
    print(("accepted: " if reply.accepted else "refused: ") + reply.detail)
    return 0 if reply.accepted else 1


def cmd_creds(args: argparse.Namespace) -> int:
    """Create (or reuse) the NATS identities and write the server configuration that admits them."""
    nodes = [node.strip() for node in args.nodes.split(",") if node.strip()]
    try:
        creds = init_credentials(Path(args.dir), nodes=nodes, base_config=deploy_dir() / "nats" / "nats.conf")
    except ValueError as exc:
        print(f"reprise creds: {exc}", file=sys.stderr)
        return 2
    identities = [creds.admin, *creds.services.values(), *creds.agents.values()]
    width = max(len(ident.name) for ident in identities)
    for ident in identities:
        print(f"{ident.name:<{width}}  {ident.public_key}  {ident.seed_file}")
    print(f"server configuration: {creds.server_config}")
    print("give each service and node only its own seed; admin.nk is for operator tools alone")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the scripted demo."""
    from reprise_cli.demo import run_demo  # noqa: PLC0415 - keeps `reprise up` start-up light

    cold = args.restart_mode == "cold"
    if cold or args.runtime == "docker":
        args.standbys = 0  # the cold path starts every rank anew; the docker demo keeps no standby containers
    return run_demo(_stack_config(args), keep=args.keep, cold=cold)


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(prog="reprise", description="Automated recovery for distributed training.")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run the whole platform locally (real NATS, Redis, services, simulated nodes)")
    _add_stack_flags(up, nodes=4, spares=1)
    up.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for every service to be ready")
    up.set_defaults(func=cmd_up)

    inject = sub.add_parser("inject", help="inject a simulated GPU fault into a node")
    inject.add_argument("--node", required=True)
    inject.add_argument("--gpu", type=int, required=True)
    inject.add_argument("--kind", choices=[k.value for k in FaultKind], default=FaultKind.XID.value)
    inject.add_argument("--xid", type=int, default=None, help="XID number (for --kind xid)")
    inject.add_argument("--nats-url", default=f"nats://127.0.0.1:{DEFAULT_PORTS['nats']}")
    inject.add_argument("--creds", default=".state/creds/admin.nk", help="NATS identity (used if the file exists)")
    inject.set_defaults(func=cmd_inject)

    creds = sub.add_parser("creds", help="create NATS identities: one per node, one per service, one admin")
    creds.add_argument("--dir", default="deploy/creds", help="where seeds (0600) and the server config go")
    creds.add_argument("--nodes", required=True, help="comma-separated node ids, e.g. node-1,node-2,spare-1")
    creds.set_defaults(func=cmd_creds)

    demo = sub.add_parser("demo", help="start the platform, train a DDP job through four faults, show the recoveries")
    _add_stack_flags(demo, nodes=4, spares=1, standbys=2, state_dir=".state/demo")  # wiped at every demo start
    demo.add_argument("--keep", action="store_true", help="keep the platform running at the end until Ctrl-C")
    demo.add_argument(
        "--restart-mode",
        choices=["auto", "cold"],
        default="auto",
        help="auto: surviving ranks restart in place, replacements on warm standbys (the fast path); cold: every rank "
        "of every recovery starts as a new process, with no standbys",
    )
    demo.set_defaults(func=cmd_demo)

    add_job_commands(sub)  # reprise job submit|list|show|cancel (jobs_cli.py)
    add_drill_command(sub)  # reprise drill --job ID --fault F
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `reprise` console script."""
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


def run() -> None:
    """Console-script wrapper: exit with main's code."""
    sys.exit(main())
