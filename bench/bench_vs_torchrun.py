"""Reprise against torchrun on the same training script, the same settings and the same faults, in one run.

Run from the repository root: ``make bench-vs-torchrun`` (or ``.venv/bin/python -m bench.bench_vs_torchrun``), about
25 minutes on 2 cores. ``--quick`` is a smoke run and ``--only reprise.hang`` (repeatable) runs a subset: they save
vs-torchrun-quick.json / vs-torchrun-partial.json, never over the full run's figures. ``--render`` prints the saved
table again (and writes it into the doc) without running anything.

examples/ddp_train.py (4 ranks, gloo on CPU, a checkpoint every K steps, ``--resume-latest --log-steps``) runs once
fault-free and once per fault under each system, every run from scratch:

  torchrun  ``--standalone --nproc-per-node 4 --max-restarts 3`` (one agent) for a rank crash (SIGKILL of a worker),
            XID 79 (to a process that is the same: the rank dies) and a hang (SIGSTOP of a worker, watched for at most
            ``--hang-bound-s``); node loss with two agents under c10d rendezvous (``--nnodes 1:2``, 2 workers each),
            one of them SIGKILLed with its workers
  reprise   the local stack (4 nodes + 1 spare, 1 rank per node), faults through the agents' injection (rank_kill,
            xid 79, rank_hang, node_loss)

The fault hits rank 3 when rank 0 prints step S. Per run, saved in bench/results/vs-torchrun.json
(``<system>.<fault>.<figure>``):

  time_to_detect_s      fault → the system noticed (torchrun: its agent's first line about the failed worker;
                        Reprise: the incident's opened_at)
  time_to_progress_s    fault → the first step completed after the restart (the script's own `step N t=` line)
  wall_s                launch → the final digest printed
  steps_redone          the fault step minus the step of the checkpoint the restart resumed from
  final_equal_to_reference   params-sha256 equal to torchrun's fault-free run's
  recovered             training moved again after the fault and reached the end (finished: reached the end)

The Markdown table of the results is printed and, after a full run, written into docs/vs-torchrun.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx

from bench import vs_torchrun_reprise, vs_torchrun_torchrun
from bench.common import RESULTS_DIR, replace_block, write_result
from bench.vs_torchrun_common import QUICK, REPO, Fault, Outcome, Settings
from reprise_common.errors import RepriseError

SYSTEMS = ("torchrun", "reprise")
DOC = REPO / "docs" / "vs-torchrun.md"
BEGIN, END = "<!-- bench-vs-torchrun:begin -->", "<!-- bench-vs-torchrun:end -->"
FAULT_NAMES = {
    Fault.RANK_CRASH: "rank crash",
    Fault.XID79: "XID 79",
    Fault.HANG: "hang",
    Fault.NODE_LOSS: "node loss",
    Fault.NONE: "none (fault-free)",
}


def run_one(system: str, fault: Fault, settings: Settings, root: Path) -> Outcome:
    """One run of one system with one fault, in a directory of its own; a run that breaks is recorded, not fatal."""
    root.mkdir(parents=True)
    began = time.time()
    try:
        if system == "reprise":
            return vs_torchrun_reprise.run(fault, settings, root)
        if fault is Fault.NODE_LOSS:
            return vs_torchrun_torchrun.run_node_loss(settings, root)
        return vs_torchrun_torchrun.run_single(fault, settings, root)
    except (RuntimeError, RepriseError, httpx.HTTPError) as exc:  # the other runs are still worth their minutes
        return Outcome(system, fault, launched_at=began, notes=[f"the run broke: {exc}"])


def summary(outcome: Outcome, settings: Settings) -> str:
    """One line per run, printed as the bench goes."""
    f = outcome.figures(None, settings)
    return (
        f"{outcome.system:<8} {outcome.fault.value:<10} detected {f['time_to_detect_s']} s, "
        f"progress {f['time_to_progress_s']} s, wall {f['wall_s']} s, resumed from {f['resumed_from_step']} "
        f"(world {f['resumed_world_size']}) {'; '.join(outcome.notes)}"
    )


def _seconds(value: float | None, missing: str) -> str:
    if value is None:
        return missing
    return f"{value:.2f} s" if value < 1 else f"{value:.1f} s"  # a sub-second detection keeps its digits


def render(document: dict[str, Any]) -> str:
    """The results as a Markdown table, with the machine, the date and the settings it ran with."""
    figures, machine = document["figures"], document["machine"]
    settings = figures["settings"]
    lines = [
        f"Measured {machine['date']} on {machine['cores']} cores ({machine['cpu_model']}, {machine['kernel']}), "
        f"{machine['python']}, torch {figures['torch']}; {settings['world_size']} ranks, {settings['steps']} steps, "
        f"a checkpoint every {settings['checkpoint_every']} steps, the fault at step {settings['fault_step']}, "
        f"{settings['step_sleep']} s sleep per step{' (--quick)' if figures['quick'] else ''}.",
        "",
        "| fault | system | detected after | training again after | steps redone | wall time | final = reference |",
        "|---|---|---|---|---|---|---|",
    ]
    notes = []
    for fault in (Fault.RANK_CRASH, Fault.XID79, Fault.HANG, Fault.NODE_LOSS, Fault.NONE):
        for system in SYSTEMS:
            run = figures.get(system, {}).get(fault.value)
            if run is None:
                continue
            bound = f"not within {settings['hang_bound_s']:g} s" if fault is Fault.HANG else "not detected"
            detected = "—" if fault is Fault.NONE else _seconds(run["time_to_detect_s"], bound)
            progress = "—" if fault is Fault.NONE else _seconds(run["time_to_progress_s"], "**not recovered**")
            equal = {True: "yes", False: "**no**", None: "—"}[run["final_equal_to_reference"]]
            redone = "—" if run["steps_redone"] is None else str(run["steps_redone"])
            lines.append(
                f"| {FAULT_NAMES[fault]} | {system} | {detected} | {progress} | {redone} | "
                f"{_seconds(run['wall_s'], 'did not finish')} | {equal} |"
            )
            notes += [f"- {system}, {FAULT_NAMES[fault]}: {note}" for note in run["notes"] if "logs kept" not in note]
    return "\n".join([*lines, "", *notes]) if notes else "\n".join(lines)


def update_doc(table: str) -> bool:
    """Replace the generated block of docs/vs-torchrun.md with `table`; False when the doc has no such block."""
    return replace_block(DOC, BEGIN, END, table)


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a shorter run per fault, for a smoke run")
    parser.add_argument("--hang-bound-s", type=float, help="how long a hung torchrun job is watched (default 120)")
    parser.add_argument("--only", action="append", default=[], metavar="SYSTEM.FAULT", help="e.g. reprise.hang")
    parser.add_argument("--keep", action="store_true", help="keep every run's directory (logs, checkpoints)")
    parser.add_argument("--render", action="store_true", help="only print (and write into the doc) the saved table")
    return parser.parse_args()


def save(outcomes: list[Outcome], settings: Settings, *, name: str, quick: bool) -> dict[str, Any]:
    """Write bench/results/<name>.json; the saved document (figures and machine)."""
    reference = next((o.digest for o in outcomes if o.system == "torchrun" and o.fault is Fault.NONE), None)
    figures: dict[str, Any] = {
        "settings": dataclasses.asdict(settings),
        "quick": quick,
        "torch": version("torch"),
        "reference_params_sha256": reference,
    }
    for outcome in outcomes:
        figures.setdefault(outcome.system, {})[outcome.fault.value] = outcome.figures(reference, settings)
    saved = write_result(name, figures)
    print("saved", saved)
    document: dict[str, Any] = json.loads(saved.read_text(encoding="utf-8"))
    return document


def main() -> None:
    """Run every selected system and fault, save the figures, print the table and (full runs) write it into the doc."""
    args = parse_args()
    # Smoke and partial runs get files of their own: they must not replace the figures of the last full run.
    name = "vs-torchrun" + ("-quick" if args.quick else "") + ("-partial" if args.only else "")
    full = name == "vs-torchrun"
    if args.render:
        table = render(json.loads((RESULTS_DIR / f"{name}.json").read_text(encoding="utf-8")))
        print(table)
        if full and update_doc(table):
            print("updated", DOC)
        return
    settings = QUICK if args.quick else Settings()
    if args.hang_bound_s:
        settings = dataclasses.replace(settings, hang_bound_s=args.hang_bound_s)
    chosen = [(s, f) for s in SYSTEMS for f in Fault if not args.only or f"{s}.{f.value}" in args.only]
    root = Path(tempfile.mkdtemp(prefix="bench-vs-torchrun-"))
    print(f"{len(chosen)} runs; their directories under {root}", flush=True)
    outcomes = []
    for system, fault in chosen:
        outcomes.append(run_one(system, fault, settings, root / f"{system}-{fault.value}"))
        print(summary(outcomes[-1], settings), flush=True)
    document = save(outcomes, settings, name=name, quick=args.quick)
    table = render(document)
    print(table)
    if full and update_doc(table):
        print("updated", DOC)
    reprise_failed = any(not run["finished"] for run in document["figures"].get("reprise", {}).values())
    if args.keep or reprise_failed:
        print(f"run directories kept under {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
