"""The supervisor's ledger (``<state>/ranks/live.json``): the ranks running now and each job's launch, written as they
change, so that the next process of this agent finds what this one left (adopts it, or reports it lost)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from reprise_common.events import LaunchArgs

LAUNCH_FILE = "launch.json"  # in <state>/ranks/<job id>/: the job's latest launch on this node


@dataclass(frozen=True)
class LostRank:
    """A rank of an earlier process of this agent, lost when that process died."""

    job_id: str
    rank: int
    restart_epoch: int
    log_path: Path

    @classmethod
    def of(cls, entry: dict[str, Any]) -> LostRank:
        """The lost rank a ledger entry names."""
        return cls(entry["job_id"], int(entry["rank"]), int(entry["restart_epoch"]), Path(entry["log"]))

    def tail(self, lines: int) -> list[str]:
        """The last lines it wrote to its log."""
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
        except OSError:
            return []


def read_ledger(path: Path) -> list[dict[str, Any]]:
    """The entries an earlier process wrote; none when it wrote no (readable) ledger."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def write_ledger(path: Path, entries: list[dict[str, Any]]) -> None:
    """Replace the ledger atomically: a reader finds the old one or the new, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(entries), encoding="utf-8")
    os.replace(partial, path)


def save_launch(job_dir: Path, spec: LaunchArgs) -> None:
    """Keep the job's launch beside its logs: an adopted rank's job needs it (rendezvous checks, numeric rules)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    partial = job_dir / f"{LAUNCH_FILE}.partial"
    partial.write_text(spec.model_dump_json(), encoding="utf-8")
    os.replace(partial, job_dir / LAUNCH_FILE)


def load_launch(job_dir: Path) -> LaunchArgs | None:
    """The job's launch an earlier process kept; None when there is none it can read."""
    try:
        return LaunchArgs.model_validate_json((job_dir / LAUNCH_FILE).read_text(encoding="utf-8"))
    except (OSError, ValidationError):
        return None
