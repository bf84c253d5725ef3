"""What both sides of bench_vs_torchrun share: the training settings, reading the script's lines, one run's outcome."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "ddp_train.py"
STEP_LINE = re.compile(r"^step (\d+) t=(\d+\.\d+)$")  # ddp_train.py --log-steps, rank 0 only
START_LINE = re.compile(r"world (\d+): starting at step (\d+)")
DIGEST_PREFIX = "params-sha256 "
POLL_S = 0.05


class Fault(StrEnum):
    """The faults compared; NONE is the fault-free run of each system."""

    NONE = "none"
    RANK_CRASH = "rank_crash"  # SIGKILL one rank
    XID79 = "xid79"  # the rank's GPU falls off the bus; to a process that means it dies
    HANG = "hang"  # SIGSTOP one rank: alive, silent, its peers blocked in the next collective
    NODE_LOSS = "node_loss"  # a whole node (its agent and its ranks) disappears


@dataclass(frozen=True)
class Settings:
    """The training run and the fault schedule, the same for every run of both systems."""

    steps: int = 200
    checkpoint_every: int = 20
    fault_step: int = 90  # the fault is injected when rank 0 reports this step
    step_sleep: float = 0.1  # changes no number (examples/README.md); makes a run last ~30 s
    world_size: int = 4
    victim_rank: int = 3
    hang_bound_s: float = 120.0  # how long a hung torchrun job is watched before it counts as not recovered
    hang_timeout_s: float = 5.0  # Reprise's hang limit for the job (policy.hang_timeout_s)
    max_restarts: int = 3  # torchrun --max-restarts and Reprise's policy.max_restarts
    run_timeout_s: float = 420.0  # a run still going after this is stopped and counts as not finished

    def script_args(self, checkpoint_dir: Path) -> list[str]:
        """ddp_train.py's arguments: only the checkpoint directory differs between runs."""
        return [
            "--steps", str(self.steps),
            "--checkpoint-every", str(self.checkpoint_every),
            "--step-sleep", f"{self.step_sleep:g}",
            "--checkpoint-dir", str(checkpoint_dir),
            "--resume-latest",
            "--log-steps",
        ]  # fmt: skip


QUICK = Settings(steps=60, checkpoint_every=10, fault_step=25, step_sleep=0.05, hang_bound_s=30.0, run_timeout_s=240.0)


# Added to a torchrun agent's environment: whatever this process inherited, the SDK stays silent and resumes nothing.
OUTSIDE_REPRISE = {"REPRISE_SDK_SOCKET": "", "REPRISE_RESUME_CHECKPOINT": ""}


def venv_command(name: str) -> str:
    """A console script installed beside this Python (torchrun)."""
    return str(Path(sys.executable).parent / name)


class LogFollower:
    """Reads the lines appended to a file as they come, stamping each with the wall-clock time it was read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[tuple[float, str]] = []
        self._offset = 0
        self._partial = b""

    def poll(self, now: float) -> list[tuple[float, str]]:
        """The complete lines written since the last poll, stamped `now`."""
        try:
            with self.path.open("rb") as source:
                source.seek(self._offset)
                chunk = source.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        *complete, self._partial = (self._partial + chunk).split(b"\n")
        fresh = [(now, line.decode(errors="replace").rstrip("\r")) for line in complete]
        self.lines.extend(fresh)
        return fresh


def step_of(line: str) -> tuple[int, float] | None:
    """(step, unix time) of a `step N t=T` line."""
    match = STEP_LINE.match(line.strip())
    return (int(match.group(1)), float(match.group(2))) if match else None


def digest_of(line: str) -> str | None:
    """The digest of a `params-sha256 <hex>` line."""
    return line.strip().removeprefix(DIGEST_PREFIX) if line.startswith(DIGEST_PREFIX) else None


@dataclass
class Outcome:
    """One run: when the fault hit, when the system noticed, when training moved again, how it ended."""

    system: str
    fault: Fault
    launched_at: float
    injected_at: float | None = None
    detected_at: float | None = None
    detected_by: str = ""
    resumed_from_step: int | None = None
    resumed_world_size: int | None = None
    progressed_at: float | None = None
    finished_at: float | None = None
    digest: str | None = None
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def after_fault(self, moment: float | None) -> float | None:
        """Seconds from the fault to `moment`, if both happened."""
        if moment is None or self.injected_at is None:
            return None
        return round(moment - self.injected_at, 2)

    def fault_due(self, line: str, settings: Settings) -> bool:
        """True when `line` is rank 0 reporting the fault step and the fault has not been injected yet."""
        step = step_of(line)
        pending = self.fault is not Fault.NONE and self.injected_at is None
        return pending and step is not None and step[0] == settings.fault_step

    def resume_from_lines(self, lines: list[tuple[float, str]], *, since: float) -> None:
        """From a stream of rank 0's lines: the first restart after `since` and the first step it completed."""
        restarted = False
        for stamp, line in lines:
            start = START_LINE.search(line)
            if not restarted and start and stamp >= since:
                restarted = True
                self.resumed_world_size, self.resumed_from_step = int(start.group(1)), int(start.group(2)) - 1
            elif restarted and (step := step_of(line)) is not None:
                self.progressed_at = step[1]
                return

    def figures(self, reference: str | None, settings: Settings) -> dict[str, Any]:
        """The run's figures, one key each."""
        faulty = self.fault is not Fault.NONE
        redone = None
        if self.resumed_from_step is not None and faulty:
            redone = settings.fault_step - self.resumed_from_step
        return {
            "finished": self.digest is not None,
            "recovered": self.progressed_at is not None and self.digest is not None if faulty else None,
            "detected": self.detected_at is not None if faulty else None,
            "time_to_detect_s": self.after_fault(self.detected_at),
            "time_to_progress_s": self.after_fault(self.progressed_at),
            "wall_s": round(self.finished_at - self.launched_at, 2) if self.finished_at else None,
            "resumed_from_step": self.resumed_from_step,
            "resumed_world_size": self.resumed_world_size,
            "steps_redone": redone,
            "final_equal_to_reference": None if self.digest is None or reference is None else self.digest == reference,
            "params_sha256": self.digest,
            "detected_by": self.detected_by,
            "notes": self.notes,
            **self.extra,
        }
