"""Recovery on Slurm or Kubernetes against the built-in backend, side by side: the demo's job and faults, both ways.

Run from the repository root: ``make bench-slurm`` or ``make bench-kubernetes`` (or ``.venv/bin/python -m
bench.bench_schedulers --scheduler kubernetes``). Each round runs ``reprise demo`` twice, once with the platform's own
agents and once on the other backend (``--scheduler slurm``: the job in a Slurm allocation of 4 nodes + 1 spare, its
agents started by srun; ``--scheduler kubernetes``: one pod per node on a local kube-apiserver, its agents run by the
kubelet double), alternating which goes first, so a busy moment of the host hits both alike. Each demo writes its
figures (demo.json: per fault the detection, the recovery and each recovery step's seconds, and the backend's own view:
on Slurm when sinfo showed the drain and the lost node, on Kubernetes when the API server showed the cordon); this
bench takes the median of each over the rounds, the ratio other / built-in per fault, and what the other backend adds
step by step. Prints a table, saves bench/results/<scheduler>.json after every round (with the host's 1-minute load
average around each demo) and puts the table into the backend's doc between its markers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import replace_block, write_result

BUILT_IN = "agents"
TARGET_RATIO = 1.5  # issues 14 (Slurm) and 43 (Kubernetes): recovery within 1.5x of the built-in backend's
DOCS = Path(__file__).resolve().parent.parent / "docs"


@dataclass(frozen=True)
class Backend:
    """A scheduler compared against the built-in agents: its demo flag, its name in the table and where it goes."""

    scheduler: str
    label: str
    doc: Path

    @property
    def markers(self) -> tuple[str, str]:
        """The doc's markers around the table."""
        return f"<!-- bench-{self.scheduler}:begin -->", f"<!-- bench-{self.scheduler}:end -->"


BACKENDS = {
    "slurm": Backend("slurm", "Slurm", DOCS / "slurm.md"),
    "kubernetes": Backend("kubernetes", "Kubernetes", DOCS / "kubernetes.md"),
}


def _load_1m() -> float:
    return round(os.getloadavg()[0], 2)


def run_demo(scheduler: str, state_dir: Path) -> dict[str, Any]:
    """One `reprise demo` with this scheduler; its demo.json (with the exit code and the load around it), or why
    there is none."""
    shutil.rmtree(state_dir, ignore_errors=True)
    argv = [sys.executable, "-m", "reprise_cli", "demo", "--scheduler", scheduler, "--state-dir", str(state_dir)]
    load_before = _load_1m()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    load = {"load_avg_1m_before": load_before, "load_avg_1m_after": _load_1m()}
    figures_file = state_dir / "demo.json"
    if not figures_file.exists():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        return {"scheduler": scheduler, "ok": False, "exit_code": done.returncode, "faults": [], "error": tail} | load
    figures: dict[str, Any] = json.loads(figures_file.read_text())
    return figures | {"exit_code": done.returncode} | load


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _cells(runs: list[dict[str, Any]], other: str) -> dict[str, dict[str, Any]]:
    """Per fault and scheduler, every recovered fault's figures as lists (the other backend's own view under its
    name)."""
    faults: dict[str, dict[str, Any]] = {}
    for run in runs:
        for fault in run["faults"]:
            cell = faults.setdefault(fault["fault"], {}).setdefault(
                run["scheduler"], {"recovery_s": [], "detection_s": [], "steps_s": {}, other: {}}
            )
            if fault.get("outcome") != "recovered":
                continue
            for key in ("recovery_s", "detection_s"):
                if fault.get(key) is not None:
                    cell[key].append(float(fault[key]))
            for step, took in fault["steps_s"].items():
                cell["steps_s"].setdefault(step, []).append(float(took))
            for key, value in (fault.get(other) or {}).items():
                if isinstance(value, (int, float)):
                    cell[other].setdefault(key, []).append(float(value))
    return faults


def summarize(runs: list[dict[str, Any]], other: str) -> dict[str, Any]:
    """Medians per fault and scheduler (recovery, detection, each step), ratios other / built-in, the other's view."""
    table: dict[str, Any] = {}
    for name, cells in _cells(runs, other).items():
        row: dict[str, Any] = {}
        for scheduler, cell in cells.items():
            row[scheduler] = {
                "count": len(cell["recovery_s"]),
                "recovery_s": _median(cell["recovery_s"]),
                "detection_s": _median(cell["detection_s"]),
                "steps_s": {step: _median(values) for step, values in cell["steps_s"].items()},
                other: {key: _median(values) for key, values in cell[other].items()},
            }
        built_in, theirs = row.get(BUILT_IN), row.get(other)
        if built_in and theirs and built_in["recovery_s"] and theirs["recovery_s"] is not None:
            row["ratio"] = round(theirs["recovery_s"] / built_in["recovery_s"], 2)
            steps = set(built_in["steps_s"]) | set(theirs["steps_s"])
            row[f"{other}_adds_s"] = {
                step: round((theirs["steps_s"].get(step) or 0.0) - (built_in["steps_s"].get(step) or 0.0), 3)
                for step in sorted(steps)
            }
        table[name] = row
    schedulers = (BUILT_IN, other)
    starts = {s: _median([r["start_s"] for r in runs if r["scheduler"] == s and r.get("start_s")]) for s in schedulers}
    loads = [r[key] for r in runs for key in ("load_avg_1m_before", "load_avg_1m_after") if key in r]
    ratios = [row["ratio"] for row in table.values() if "ratio" in row]
    return {
        "faults": table,
        "job_start_s": starts,
        "worst_ratio": max(ratios) if ratios else None,
        "within_target": bool(ratios) and len(ratios) == len(table) and max(ratios) <= TARGET_RATIO,
        "target_ratio": TARGET_RATIO,
        "demos_ok": {s: sum(1 for r in runs if r["scheduler"] == s and r.get("ok")) for s in schedulers},
        "demos": {s: sum(1 for r in runs if r["scheduler"] == s) for s in schedulers},
        "load_avg_1m": {"min": min(loads), "median": _median(loads), "max": max(loads)} if loads else None,
    }


def render(summary: dict[str, Any], backend: Backend) -> str:
    """The markdown table for the backend's doc."""
    label, other = backend.label, backend.scheduler
    lines = [
        f"| fault | built-in: recovery s | {label}: recovery s | {label} / built-in | "
        f"what {label} adds (median s per step) |",
        "|---|---|---|---|---|",
    ]
    for name, row in summary["faults"].items():
        built_in, theirs = row.get(BUILT_IN) or {}, row.get(other) or {}
        adds = ", ".join(f"{step} {took:+.2f}" for step, took in (row.get(f"{other}_adds_s") or {}).items() if took)
        lines.append(
            f"| {name} | {built_in.get('recovery_s')} | {theirs.get('recovery_s')} | {row.get('ratio', '—')} | "
            f"{adds or '—'} |"
        )
    return "\n".join(lines)


def save(runs: list[dict[str, Any]], backend: Backend, *, rounds: int, rounds_done: int) -> dict[str, Any]:
    """Summarise the runs so far, save them as bench/results/<scheduler>.json and put the table into the doc."""
    summary = summarize(runs, backend.scheduler)
    figures = summary | {
        "scheduler": backend.scheduler,
        "rounds": rounds,
        "rounds_done": rounds_done,
        "complete": rounds_done == rounds,
        "load_avg_1m_end": _load_1m(),
        "runs": runs,
    }
    write_result(backend.scheduler, figures)
    replace_block(backend.doc, *backend.markers, render(summary, backend))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", choices=sorted(BACKENDS), required=True, help="the backend to compare")
    parser.add_argument("--rounds", type=int, default=5, help="demos of each kind (default 5)")
    args = parser.parse_args(argv)
    backend = BACKENDS[args.scheduler]
    schedulers = (BUILT_IN, backend.scheduler)
    runs: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix=f"bench-{backend.scheduler}-") as scratch:
        for round_index in range(args.rounds):
            order = schedulers if round_index % 2 == 0 else tuple(reversed(schedulers))
            for scheduler in order:
                run = run_demo(scheduler, Path(scratch) / f"{scheduler}-{round_index}")
                runs.append(run)
                recoveries = ", ".join(f"{f['fault']} {f['recovery_s'] or 0:.2f} s" for f in run["faults"])
                print(
                    f"round {round_index + 1} {scheduler:<10}: ok={run.get('ok')} {recoveries} "
                    f"(load {run['load_avg_1m_before']} -> {run['load_avg_1m_after']})",
                    flush=True,
                )
                if run.get("error"):
                    print(run["error"], flush=True)
            summary = save(runs, backend, rounds=args.rounds, rounds_done=round_index + 1)
    print(render(summary, backend))
    print(
        f"worst ratio {summary['worst_ratio']} (target <= {TARGET_RATIO}); demos passed: {summary['demos_ok']} of "
        f"{summary['demos']}; job start (submit -> running) median: {summary['job_start_s']}; "
        f"1-minute load {summary['load_avg_1m']}"
    )
    print(f"saved bench/results/{backend.scheduler}.json and the table in {backend.doc}")
    return 0 if summary["within_target"] and summary["demos_ok"] == summary["demos"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
