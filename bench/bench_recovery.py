"""Recovery side by side: the same script through the same faults, Reprise cold, Reprise's fast path, a torchrun loop.

Run from the repository root: ``make bench-recovery`` (or ``.venv/bin/python -m bench.bench_recovery``). ``--quick``
is a smoke run (one fault per cell; saved as recovery-quick.json, never over the full figures), ``--only fast``
or ``--only loop.hang`` (repeatable) runs a subset and replaces just those cells in the saved file (each cell keeps
its own date and load average), ``--render`` prints the saved table again and writes it into docs/benchmarks.md.

examples/ddp_train.py (4 ranks, gloo on CPU, ``--resume-latest --log-steps``, a checkpoint every 10 steps) runs once
per cell (the compared cells: once per round, below), a cell being a system and a fault kind:

  cold   Reprise, policy ``restart_mode: "cold"``, no standbys: every recovery restarts every rank as a new process
  fast   Reprise, policy ``restart_mode: "auto"``, the script with ``--in-place`` (surviving ranks restart in their
         processes), 2 warm standbys per node, every rank restoring the checkpoint (``REPRISE_PEER_RESTORE=0``);
         skipped, with the reason, while the script has no ``--in-place``
  peer   the fast path with peer recovery: the ranks go on from the survivors' state (``reprise_sdk.torch.replica``),
         the checkpoint only when they cannot agree on it
  loop   ``until torchrun --max-restarts 0 ...; do :; done`` (bench/recovery_loop.py): every failure restarts it all
  cold-container, fast-container
         cold and fast with each rank in a container of the base image on the stack's own dockerd
         (bench/recovery_containers.py); on the fast path the agents keep standby containers of the job (its nodes
         and the first 2 spares; REPRISE_CONTAINER_STANDBYS 2, no standby interpreters), cold has none. Each is
         compared with its process cell (the ratio and the recovery's launch step, the ranks' start overhead) under
         the table

Faults, each on rank 3: a rank crash (SIGKILL), XID 79 (Reprise: the agent's simulated GPU falls off the bus and the
rank dies; the loop: the same SIGKILL, all a process sees), a hang (SIGSTOP; Reprise's job limit hang_timeout_s 3 s),
a node loss (Reprise: the agent and its ranks vanish; the loop: one of two node loops, bench/recovery_loop.py).

Several faults hit one run (5 per cell; --quick 1): the first when rank 0 prints step 25, each next one at the first
step past the last fault's that is 5 past a checkpoint (35, 45, ...), and only once training has moved again after
the last fault at the full world size (the fast path also waits for a ready standby on every node; the loop's node
loss for its replacement node). Every fault therefore redoes 5 steps from the checkpoint (none on the peer path), and
no fault hits a recovery still under way. A fast-path fault that would have to hit without a ready standby because the
run is ending is not injected (it would measure a cold start): such a cell has fewer faults, as its note says, and
one that has none yet gets its one fault without them.

Rounds: the cells a container ratio compares (cold, fast and their container cells) run twice (``--rounds N``;
--quick once). A fault's row runs first, each container cell right after its process cell; then those cells again in
the reverse order, so that on average each side of a ratio ran at the same point of the row (a load that drifts
weighs on both alike). A cell's figures pool its rounds' faults, and list each round's own median. Before every run
the bench waits until the CPUs were under 25 % busy for 2 s (at most 60 s): what the run before left behind (a stack
going down, the daemon removing containers) has ended.

Per cell (bench/results/recovery.json, ``figures.cells.<system>.<fault>``): fault → the first step completed after
the restart (the script's own ``step N t=`` line), its median and range over the faults, detection (Reprise: the
incident's opened_at; the loop: torchrun's first line about the failed worker), steps redone, whether the final
parameters equal the fault-free reference's (the script alone, world 1: the result does not depend on the world size
nor on restarts, examples/README.md), the standbys' memory (their RSS in the node reports), the checkpoint save cost
the registry's advisor measured, and the load average. The Markdown table is printed and written into
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx

from bench import recovery_loop, recovery_reprise
from bench.common import RESULTS_DIR, wait_quiet, write_result
from bench.recovery_render import render, update_doc
from bench.recovery_track import (
    CONTAINER_PAIRS,
    FAULTS,
    FULL,
    QUICK,
    CellRun,
    RecoverySettings,
    System,
    pooled,
)
from bench.vs_torchrun_common import OUTSIDE_REPRISE, REPO, SCRIPT, Fault, digest_of
from reprise_common.errors import RepriseError

IN_PLACE_FLAG = "--in-place"


def fast_path_missing() -> str:
    """Why the fast path cannot run ("" when it can): the script must take --in-place."""
    helped = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    return "" if IN_PLACE_FLAG in helped.stdout else f"examples/ddp_train.py has no {IN_PLACE_FLAG} yet"


def reference_digest(settings: RecoverySettings, root: Path) -> str | None:
    """The fault-free result: the script alone (a world of one, no sleeps, no checkpoints)."""
    argv = [sys.executable, str(SCRIPT), "--steps", str(settings.steps), "--checkpoint-every", "0",
            "--checkpoint-dir", str(root / "reference")]  # fmt: skip
    env = {**os.environ, **OUTSIDE_REPRISE, "WORLD_SIZE": "1", "RANK": "0"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False, env=env, cwd=REPO)
    return next((d for line in done.stdout.splitlines() if (d := digest_of(line))), None)


def run_cell(system: System, fault: Fault, settings: RecoverySettings, root: Path) -> CellRun:
    """One cell in a directory of its own; a run that breaks is recorded, not fatal."""
    try:
        if system is System.LOOP:
            return recovery_loop.run_cell(fault, settings, root)
        return recovery_reprise.run_cell(system, fault, settings, root)
    except (RuntimeError, RepriseError, httpx.HTTPError) as exc:  # the other cells are still worth their minutes
        broken = CellRun(system, fault, launched_at=time.time())
        broken.notes.append(f"the run broke: {exc}")
        return broken


def summary(cell: CellRun) -> str:
    """One line per cell, printed as the bench goes."""
    f = cell.figures(None)
    if cell.skipped:
        return f"{cell.system:<5} {cell.fault.value:<10} skipped: {cell.skipped}"
    return (
        f"{cell.system:<5} {cell.fault.value:<10} {f['faults_recovered']}/{f['faults_injected']} recovered, "
        f"progress median {f['time_to_progress_s_median']} s {f['time_to_progress_s_range']}, detected "
        f"{f['time_to_detect_s_median']} s, redone {f['steps_redone_median']}, wall {f['wall_s']} s "
        f"{'; '.join(cell.notes)}"
    )


def selected(only: list[str]) -> list[tuple[System, Fault]]:
    """The cells `--only` names (a system, or system.fault), all of them without it."""
    cells = [(system, fault) for fault in FAULTS for system in System]  # a fault's row complete before the next
    return [(s, f) for s, f in cells if not only or s.value in only or f"{s.value}.{f.value}" in only]


def schedule(chosen: list[tuple[System, Fault]], rounds: int) -> list[tuple[System, Fault]]:
    """The order the runs go in: a fault's row complete before the next, each container cell right after its process
    cell; every further round runs again, in the reverse order, the cells of a pair compared (both chosen), so that
    each side of a ratio was measured as early in the row as the other on average (a load that drifts weighs on
    both alike)."""
    order = []
    for fault in FAULTS:
        row = [(s, f) for s, f in chosen if f is fault]
        paired = [(s, f) for s, f in row if _partner(s) is not None and (_partner(s), f) in row]
        first = sorted(row, key=lambda cell: _position(cell[0]))
        compared = sorted(paired, key=lambda cell: _position(cell[0]))
        order += first
        for again in range(1, rounds):
            order += compared[::-1] if again % 2 else compared
    return order


def _partner(system: System) -> System | None:
    """The cell a container cell is compared with, and the other way round."""
    pairs = dict(CONTAINER_PAIRS)
    return pairs.get(system) or next((boxed for boxed, bare in pairs.items() if bare is system), None)


def _position(system: System) -> tuple[int, int]:
    """Where a system's cell runs in its row: each process cell, then its container cell, then the others."""
    bare = system if not system.in_containers else _partner(system)
    if bare is None or _partner(bare) is None:
        return (len(System), list(System).index(system))
    return (list(System).index(bare), int(system.in_containers))


def save(cells: list[CellRun], settings: RecoverySettings, *, name: str, reference: str | None) -> dict[str, Any]:
    """Write bench/results/<name>.json, keeping the cells of the saved file (same settings) these do not replace."""
    previous = RESULTS_DIR / f"{name}.json"
    kept: dict[str, Any] = {}
    if previous.exists():
        old = json.loads(previous.read_text(encoding="utf-8"))["figures"]
        if old.get("settings") == dataclasses.asdict(settings):
            kept = old.get("cells", {})
    for cell in cells:
        kept.setdefault(cell.system.value, {})[cell.fault.value] = cell.figures(reference)
    figures = {
        "settings": dataclasses.asdict(settings),
        "quick": settings.faults == QUICK.faults,
        "torch": version("torch"),
        "reference_params_sha256": reference,
        "cells": kept,
    }
    saved = write_result(name, figures)
    print("saved", saved)
    document: dict[str, Any] = json.loads(saved.read_text(encoding="utf-8"))
    return document


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="one fault per cell, for a smoke run")
    parser.add_argument("--only", action="append", default=[], metavar="SYSTEM[.FAULT]", help="e.g. fast, loop.hang")
    parser.add_argument("--rounds", type=int, metavar="N", help="runs of each compared cell (default 2, --quick 1)")
    parser.add_argument("--keep", action="store_true", help="keep every run's directory (logs, checkpoints)")
    parser.add_argument("--render", action="store_true", help="only print (and write into the doc) the saved table")
    return parser.parse_args()


def main() -> None:
    """Run the selected cells, save the figures, print the table and write it into the doc."""
    args = parse_args()
    name = "recovery-quick" if args.quick else "recovery"
    if args.render:
        table = render(json.loads((RESULTS_DIR / f"{name}.json").read_text(encoding="utf-8")))
        print(table)
        if update_doc(table, quick=args.quick):
            print("updated docs/benchmarks.md")
        return
    settings = QUICK if args.quick else FULL
    chosen = selected(args.only)
    if not chosen:
        raise SystemExit(f"no cell is named by --only {' '.join(args.only)}: systems {[s.value for s in System]}")
    rounds = args.rounds or (1 if args.quick else 2)
    runs_in_order = schedule(chosen, rounds)
    root = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    missing = fast_path_missing() if any(system.in_place for system, _ in chosen) else ""
    reference = reference_digest(settings, root)
    print(f"{len(chosen)} cells, {len(runs_in_order)} runs under {root}; reference {reference}", flush=True)
    runs: dict[tuple[System, Fault], list[CellRun]] = {}
    for system, fault in runs_in_order:
        done = runs.setdefault((system, fault), [])
        if system.in_place and missing:
            run = CellRun(system, fault, launched_at=time.time(), skipped=missing)
        else:
            quiet = wait_quiet()  # what the last run left behind has ended
            run = run_cell(system, fault, settings, root / f"{system.value}-{fault.value}-{len(done) + 1}")
            run.extra["quiet_before"] = quiet
        done.append(run)
        print(f"round {len(done)}: {summary(run)}", flush=True)
        document = save([pooled(done)], settings, name=name, reference=reference)  # a run cut short keeps its cells
    cells = [run for done in runs.values() for run in done]
    table = render(document)
    print(table)
    if update_doc(table, quick=args.quick):
        print("updated docs/benchmarks.md")
    if args.keep or any(not cell.digest and not cell.skipped for cell in cells):
        print(f"run directories kept under {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
