"""bench_recovery's saved figures as a Markdown table, and that table in docs/benchmarks.md between its markers."""

from __future__ import annotations

from typing import Any

from bench.common import RESULTS_DIR, replace_block
from bench.recovery_track import CONTAINER_PAIRS, FAULTS, System
from bench.vs_torchrun_common import REPO, Fault

DOC = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench-recovery:begin -->", "<!-- bench-recovery:end -->"
FAULT_NAMES = {Fault.RANK_CRASH: "rank crash", Fault.XID79: "XID 79", Fault.HANG: "hang", Fault.NODE_LOSS: "node loss"}
SYSTEM_NAMES = {
    System.COLD: "Reprise cold",
    System.FAST: "Reprise fast path, checkpoint",
    System.PEER: "Reprise fast path, peer state",
    System.LOOP: "torchrun loop",
    System.COLD_CONTAINER: "Reprise cold, containers",
    System.FAST_CONTAINER: "Reprise fast path, containers",
}


def seconds(value: float | None, missing: str = "—") -> str:
    """A duration as the table shows it: two digits under 10 s, one above."""
    if value is None:
        return missing
    return f"{value:.2f} s" if value < 10 else f"{value:.1f} s"


def render(document: dict[str, Any]) -> str:
    """The cells as a Markdown table, with the machine, the date, the settings and each cell's notes."""
    figures, machine = document["figures"], document["machine"]
    settings, cells = figures["settings"], figures["cells"]
    measured = sorted(c["measured_at"] for row in cells.values() for c in row.values() if c.get("measured_at"))
    span = f" (its cells measured from {measured[0]} to {measured[-1]})" if measured else ""
    lines = [
        f"{'**Smoke run (`--quick`), 1 fault per cell**' if figures['quick'] else 'Full run'}, saved "
        f"{machine['date']}{span} on {machine['cores']} cores ({machine['cpu_model']}, {machine['kernel']}), "
        f"{machine['python']}, torch {figures['torch']}; {settings['world_size']} ranks, {settings['steps']} steps, "
        f"a checkpoint every {settings['checkpoint_every']} steps, first fault at step {settings['fault_step']}, "
        f"{settings['step_sleep']} s sleep per step, hang limit {settings['hang_timeout_s']:g} s.",
        "",
        "| fault | system | faults recovered | fault → training again, median (range) | vs cold | detected after "
        "(median) | steps redone | final = reference | restart path | standbys' RSS | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for fault in FAULTS:
        for system in System:
            cell = cells.get(system.value, {}).get(fault.value)
            if cell is not None:
                cold = System.COLD_CONTAINER if system.in_containers else System.COLD  # its own runtime's cold path
                lines.append(_row(fault, system, cell, cells.get(cold.value, {}).get(fault.value, {})))
                notes += [f"- {SYSTEM_NAMES[system]}, {FAULT_NAMES[fault]}: {n}" for n in _notes(cell)]
        notes += _container_notes(fault, cells)
    return "\n".join([*lines, "", *notes]) if notes else "\n".join(lines)


def _row(fault: Fault, system: System, cell: dict[str, Any], cold_cell: dict[str, Any]) -> str:
    head = f"| {FAULT_NAMES[fault]} | {SYSTEM_NAMES[system]} |"
    if cell.get("skipped"):
        return f"{head} not run: {cell['skipped']} | | | | | | | | |"
    median, spread = cell["time_to_progress_s_median"], cell["time_to_progress_s_range"]
    progress = "**not recovered**" if median is None else seconds(median)
    if spread and spread[0] != spread[1]:
        progress += f" ({seconds(spread[0])} to {seconds(spread[1])})"
    cold = cold_cell.get("time_to_progress_s_median")
    ratio = f"{cold / median:.1f} x" if cold and median and cold_cell is not cell else "—"
    equal = {True: "yes", False: "**no**", None: "—"}[cell["final_equal_to_reference"]]
    redone = "—" if cell["steps_redone_median"] is None else f"{cell['steps_redone_median']:g}"
    rss = "—" if not cell.get("standby_rss_mb_median") else f"{cell['standby_rss_mb_median']:.0f} MB each"
    load = " to ".join(f"{x:.1f}" for x in cell["load_average_1m"])
    paths = ", ".join(f"{path.replace('_', ' ')} x{count}" for path, count in cell.get("restart_paths", {}).items())
    return (
        f"{head} {cell['faults_recovered']} of {cell['faults_injected']} | {progress} | {ratio} | "
        f"{seconds(cell['time_to_detect_s_median'])} | {redone} | {equal} | {paths or '—'} | {rss} | {load} |"
    )


def _container_notes(fault: Fault, cells: dict[str, Any]) -> list[str]:
    """Each container cell against its process cell: fault → training again, and the launch step (the start
    overhead of the ranks' containers)."""
    notes = []
    for containers, processes in CONTAINER_PAIRS:
        boxed, bare = (cells.get(s.value, {}).get(fault.value) or {} for s in (containers, processes))
        progress = (boxed.get("time_to_progress_s_median"), bare.get("time_to_progress_s_median"))
        launch = (boxed.get("launching_s_median"), bare.get("launching_s_median"))
        if progress[0] is None or not progress[1]:
            continue
        line = f"- {SYSTEM_NAMES[containers]}, {FAULT_NAMES[fault]}: {progress[0] / progress[1]:.2f} x the processes'"
        if each := _round_ratios(boxed, bare):
            line += f" (pooled over {len(each)} rounds in alternating order; round by round {', '.join(each)})"
        if launch[0] is not None and launch[1] is not None:
            line += f"; launch step {seconds(launch[0])} vs {seconds(launch[1])}"
        notes.append(line)
    return notes


def _round_ratios(boxed: dict[str, Any], bare: dict[str, Any]) -> list[str]:
    """Containers ÷ processes of each round two pooled cells both recovered in (none for cells of one run)."""
    pairs = zip(boxed.get("rounds", []), bare.get("rounds", []), strict=False)
    medians = [(a.get("time_to_progress_s_median"), b.get("time_to_progress_s_median")) for a, b in pairs]
    return [f"{a / b:.2f}" for a, b in medians if a and b]


def _notes(cell: dict[str, Any]) -> list[str]:
    return [note for note in cell.get("notes", []) if "logs kept" not in note]


def update_doc(table: str, *, quick: bool) -> bool:
    """Write `table` between the markers of docs/benchmarks.md; a smoke run never replaces a full run's table."""
    if quick and (RESULTS_DIR / "recovery.json").exists():
        return False
    return replace_block(DOC, BEGIN, END, table)
