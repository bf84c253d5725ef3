"""The demo's training job: examples/ddp_train.py with fixed settings, under Reprise or as a plain local gloo group."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reprise_cli.demo.errors import DemoFailure
from reprise_cli.servers import ManagedProcess, free_port, wait_until
from reprise_cli.topology import rank_runtime_paths
from reprise_common.errors import ConfigError

DIGEST_PREFIX = "params-sha256 "


def example_script() -> Path:
    """examples/ddp_train.py of this repository (the CLI is installed editable from it)."""
    script = Path(__file__).resolve().parents[3] / "examples" / "ddp_train.py"
    if not script.is_file():
        raise ConfigError(f"{script} not found: the demo runs from a checkout of the repository (make venv)")
    return script


@dataclass(frozen=True)
class Training:
    """What the job trains and how; the fault-free reference trains the same (only the step sleep differs)."""

    steps: int = 120
    checkpoint_every: int = 10  # a save costs the job ~0.04 s: at the demo's fault rate the advisor says ~5-9 steps
    global_batch: int = 64
    micro_batch: int = 8
    seed: int = 0
    step_sleep: float = 0.1  # slows the job so faults land mid-run; changes no number (examples/README.md)
    in_place: bool = True  # under Reprise the ranks that survive a fault restart in place (reprise_sdk.run)
    peer_restore: bool = True  # ...and go on from the survivors' state, not the checkpoint (reprise_sdk.torch.replica)

    def argv(self, *, checkpoint_dir: Path, output: Path, step_sleep: float | None = None) -> list[str]:
        """The script's command line, interpreter first."""
        sleep = self.step_sleep if step_sleep is None else step_sleep
        return [
            sys.executable, str(example_script()),
            "--steps", str(self.steps),
            "--checkpoint-every", str(self.checkpoint_every),
            "--global-batch", str(self.global_batch),
            "--micro-batch", str(self.micro_batch),
            "--seed", str(self.seed),
            "--step-sleep", f"{sleep:g}",
            "--checkpoint-dir", str(checkpoint_dir),
            "--output", str(output),
        ]  # fmt: skip


def training_env(training: Training) -> dict[str, str]:
    """The job's environment: a rank restarted in place keeps its newest checkpoint in memory (64 MiB at most), and
    takes the survivors' state unless peer recovery is off."""
    if not training.in_place:
        return {}
    return {"REPRISE_SDK_KEEP_BYTES": str(64 << 20)} | ({} if training.peer_restore else {"REPRISE_PEER_RESTORE": "0"})


def job_spec(
    training: Training,
    *,
    name: str,
    nodes: int,
    min_nodes: int,
    work_dir: Path,
    hang_timeout_s: float = 3.0,
    objective_s: float = 60.0,
    image: str | None = None,
) -> dict[str, Any]:
    """The POST /v1/jobs body: one rank per node, checkpoints and the output under work_dir, a demo's policy; with
    `image`, each rank in a container of it (container_section)."""
    checkpoints = work_dir / "checkpoints"
    container = {"container": container_section(image, work_dir=work_dir)} if image is not None else {}
    return container | {
        "name": name,
        "node_count": nodes,
        "ranks_per_node": 1,
        "command": [
            *training.argv(checkpoint_dir=checkpoints, output=work_dir / "output" / "final.pt"),
            *(["--in-place"] if training.in_place else []),
        ],
        # A rank restarted in place restores from its own copy of the newest checkpoint when the registry validated it.
        "env": training_env(training),
        "working_dir": str(work_dir),
        "checkpoint_dir": str(checkpoints),
        "policy": {
            "elastic_min_nodes": min_nodes,
            "hang_timeout_s": hang_timeout_s,  # the ranks step ~10 times a second: 3 s of silence is a hang
            "recovery_time_objective_s": objective_s,
            "backoff_initial_s": 0,  # every fault here restores a newer checkpoint: no reason to wait
            "restart_mode": "auto" if training.in_place else "cold",
        },
    }


def container_section(image: str, *, work_dir: Path) -> dict[str, Any]:
    """A job's `container` section: the image, the job's directory (checkpoints, output) read-write, and read-only
    what the script runs from (the host's Python, the checkout's .venv, SDK and examples, docs/containers.md)."""
    mounts: list[dict[str, Any]] = [{"source": str(path), "target": str(path)} for path in rank_runtime_paths()]
    mounts.append({"source": str(work_dir), "target": str(work_dir), "read_only": False})
    return {"image": image, "mounts": mounts}


@dataclass(frozen=True)
class Reference:
    """The fault-free run: rank 0's digest of the final parameters and how long the group took."""

    digest: str
    wall_s: float
    output: Path


class ReferenceRun:
    """The fault-free run without Reprise: a plain gloo group of local processes with torchrun's variables."""

    def __init__(self, training: Training, *, world_size: int, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.output = work_dir / "final.pt"
        # No sleep: it changes no number, and the reference only has to reach the same parameters, not be watched.
        argv = training.argv(checkpoint_dir=work_dir / "checkpoints", output=self.output, step_sleep=0.0)
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(world_size),
            "REPRISE_SDK_SOCKET": "",  # outside Reprise the SDK stays silent and nothing resumes
            "REPRISE_RESUME_CHECKPOINT": "",
        }
        self.ranks = [
            ManagedProcess(
                f"reference-rank-{r}", argv, work_dir / f"rank-{r}.log", env | {"RANK": str(r), "LOCAL_RANK": str(r)}
            )
            for r in range(world_size)
        ]
        self.began = 0.0

    def start(self) -> ReferenceRun:
        """Start every rank; returns at once."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.began = time.monotonic()
        for rank in self.ranks:
            rank.start()
        return self

    def stop(self) -> None:
        """Stop every rank still running (an interrupted demo)."""
        for rank in self.ranks:
            rank.stop(grace_s=2.0)

    def finish(self, *, timeout_s: float = 240.0) -> Reference:
        """Wait for the group to end; rank 0's digest (DemoFailure when the run failed)."""
        try:
            done = wait_until(lambda: not any(r.alive() for r in self.ranks), timeout_s=timeout_s, interval_s=0.1)
            wall = time.monotonic() - self.began
        finally:
            codes = [rank.stop(grace_s=2.0) for rank in self.ranks]
        rank0 = self.ranks[0]
        digest = digest_in(rank0.log_path)
        if not done or any(codes) or digest is None:
            raise DemoFailure(f"the fault-free reference run failed (exit codes {codes}): see {rank0.log_path}")
        return Reference(digest=digest, wall_s=wall, output=self.output)


def digest_in(log_path: Path) -> str | None:
    """The `params-sha256` digest rank 0 printed at the end of its log, if it got there."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    lines = [line for line in text.splitlines() if line.startswith(DIGEST_PREFIX)]
    return lines[-1].removeprefix(DIGEST_PREFIX).strip() if lines else None


def rank_log(agent_state_dir: Path, *, job_id: str, restart_epoch: int, rank: int) -> Path:
    """Where a node's agent writes a rank's output (services/agent/reprise_agent/ranks.py)."""
    return agent_state_dir / "ranks" / job_id / f"epoch-{restart_epoch}-rank-{rank}.log"
