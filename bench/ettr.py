"""What the recovery overheads measured by bench_recovery mean for a fleet: expected ETTR at 1,024 to 131,072 GPUs.

Run from the repository root: ``make bench-ettr`` (or ``.venv/bin/python -m bench.ettr``) after ``make bench-recovery``;
it reads bench/results/recovery.json (recovery-quick.json when there is no full run, and says so), prints the formulas
and every input, saves bench/results/ettr.json and writes its tables into docs/benchmarks.md (plots: printed only).

The arithmetic is the checkpoint registry's advisor's (reprise_registry.advisor.formulas), not a copy of it:

  M    = 86,400 / (N · r)                         the job's mean time between failures (s), N nodes, r per node-day
  T    = √(2δM)·[1 + ⅓·√(δ/2M) + (δ/2M)/9] - δ    Daly's checkpoint interval (the advisor's recommendation)
  ETTR = [1 - (u0 + T/2)/M] / (1 + δ/T)           expected effective training time ratio

with δ the checkpoint save cost and u0 the restart overhead: what one failure costs besides the work since the last
checkpoint, i.e. fault → training moving again. u0 is the mean, over the four fault kinds, of each system's median
(equal weights: the published rates do not split failures by kind); δ is the registry's measured save cost of the
benchmark's job, the same for every system (the same script writes the same checkpoints). A cell that never
recovered (the torchrun loop's hang) gets an estimate, printed as one: the script's collective timeout, after which the
loop restarts, plus that system's rank-crash recovery.

No step lost (issue 41): a failure that the ranks recover from a surviving peer's state redoes no step, so only the
share f of failures that fall back to a checkpoint loses T/2 on average; a background save holds training for its
blocking time δb only. With M' = M / f (the time between failures that need the checkpoint):

  T    = Daly's interval at δb and M'
  ETTR = [1 - u0/M - f·T/(2M)] / (1 + δb/T)   (the formula above with δ = δb, M = M' and u0 = u0/f)

Inputs: a 60 s synchronous save (the model the issue names: a large model's checkpoint to shared storage); δb = 60 s
times the blocking ratio bench-checkpoint measured (a background save of 1 GiB against a synchronous one, side by side);
u0 the peer cells' mean fault → training again (the fast path's when the peer cells are missing, said so); and f,
an assumption, not a measurement: 0.15, for the faults whose survivors' state cannot be trusted or that leave no
survivor (a software bug that fails every rank at once, silent data corruption, a numeric fault, a job-wide outage),
with f = 0.05, 0.3 and 1 beside it to show how much rests on it.

Failure rates, with 8 GPUs per node: Llama 3's (419 unexpected interruptions in 54 days on 16,384 GPUs, "The Llama 3
Herd of Models", 2024), and the ends of the range issue 15 cites for large clusters, 2.3 and 6.5 per 1,000 node-days.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from bench.common import RESULTS_DIR, replace_block, write_result
from bench.recovery_render import DOC, SYSTEM_NAMES
from bench.recovery_track import SCRIPT_COLLECTIVE_TIMEOUT_S, System
from bench.vs_torchrun_common import Fault
from reprise_registry.advisor import formulas
from reprise_registry.advisor.views import DEFAULT_SAVE_COST_S

GPU_COUNTS = (1_024, 16_384, 131_072)
GPUS_PER_NODE = 8
BEGIN, END = "<!-- bench-ettr:begin -->", "<!-- bench-ettr:end -->"
SYNC_SAVE_MODEL_S = 60.0  # the synchronous save the no-step-lost projection assumes (a large model, shared storage)
FALLBACK_SHARE = 0.15  # assumed share of failures that still need the checkpoint (module docstring)
FALLBACK_SHARES = (0.05, FALLBACK_SHARE, 0.3, 1.0)
PLOT_WIDTH = 50  # characters of the widest bar


@dataclass(frozen=True)
class FailureRate:
    """A published failure rate, per node per day."""

    name: str
    per_node_day: float
    source: str


def llama3_per_node_day() -> float:
    """Llama 3's 419 unexpected interruptions in 54 days on 16,384 GPUs, per 8-GPU node per day."""
    return 419 / (54 * 16_384 / GPUS_PER_NODE)


RATES = (
    FailureRate("2.3 per 1,000 node-days", 2.3e-3, "the low end of the range issue 15 cites"),
    FailureRate("Llama 3", llama3_per_node_day(), "419 interruptions in 54 days on 16,384 GPUs = 3.79 per 1,000"),
    FailureRate("6.5 per 1,000 node-days", 6.5e-3, "the high end of the range issue 15 cites"),
)


@dataclass(frozen=True)
class Overhead:
    """One system's restart overhead u0 and where it came from."""

    system: System
    restart_overhead_s: float
    per_fault_s: dict[str, float]
    estimated: dict[str, str]
    detection_s: float | None


def overheads(cells: dict[str, Any]) -> dict[System, Overhead]:
    """Each measured system's u0: the mean over the fault kinds of its median fault → training again."""
    found = {}
    for system in System:
        mine = {f: c for f, c in cells.get(system.value, {}).items() if not c.get("skipped")}
        per_fault = {f: c["time_to_progress_s_median"] for f, c in mine.items() if c["time_to_progress_s_median"]}
        estimated = {}
        crash = per_fault.get(Fault.RANK_CRASH.value)
        if Fault.HANG.value in mine and Fault.HANG.value not in per_fault and crash is not None:
            per_fault[Fault.HANG.value] = SCRIPT_COLLECTIVE_TIMEOUT_S + crash
            estimated[Fault.HANG.value] = (
                f"not recovered in the run: the collective timeout ({SCRIPT_COLLECTIVE_TIMEOUT_S:g} s) "
                f"+ its rank-crash recovery ({crash:g} s)"
            )
        if not per_fault:
            continue
        detections = [c["time_to_detect_s_median"] for c in mine.values() if c["time_to_detect_s_median"] is not None]
        found[system] = Overhead(
            system,
            restart_overhead_s=statistics.mean(per_fault.values()),
            per_fault_s=per_fault,
            estimated=estimated,
            detection_s=statistics.mean(detections) if detections else None,
        )
    return found


def save_cost_s(cells: dict[str, Any]) -> float:
    """The checkpoint save cost: the median of what the registry's advisor measured in the Reprise cells."""
    costs = [c["save_cost_s"] for by_fault in cells.values() for c in by_fault.values() if c.get("save_cost_s")]
    if not costs:
        raise SystemExit("no checkpoint save cost in the recovery results: run make bench-recovery first")
    return float(statistics.median(costs))


@dataclass(frozen=True)
class Projection:
    """One fleet size at one failure rate: the job's MTBF, the advisor's interval, and the ETTR it buys."""

    gpus: int
    nodes: int
    rate: str
    failures_per_day: float
    mtbf_s: float
    interval_s: float
    ettr: float


def project(*, gpus: int, rate: FailureRate, save_cost: float, restart_overhead: float) -> Projection:
    """The advisor's arithmetic for a job on `gpus` GPUs."""
    nodes = gpus // GPUS_PER_NODE
    mtbf = formulas.job_mtbf_s(node_count=nodes, failures_per_node_day=rate.per_node_day)
    interval = formulas.daly_interval_s(save_cost_s=save_cost, mtbf_s=mtbf)
    ettr = formulas.expected_ettr(
        interval_s=interval, save_cost_s=save_cost, mtbf_s=mtbf, restart_overhead_s=restart_overhead
    )
    return Projection(gpus, nodes, rate.name, nodes * rate.per_node_day, mtbf, interval, ettr)


def project_no_step_lost(
    *, gpus: int, rate: FailureRate, blocking_save_s: float, fallback_share: float, restart_overhead: float
) -> Projection:
    """The advisor's arithmetic when only `fallback_share` of the failures lose the work since the checkpoint."""
    nodes = gpus // GPUS_PER_NODE
    mtbf = formulas.job_mtbf_s(node_count=nodes, failures_per_node_day=rate.per_node_day)
    needing = mtbf / fallback_share
    interval = formulas.daly_interval_s(save_cost_s=blocking_save_s, mtbf_s=needing)
    ettr = formulas.expected_ettr(
        interval_s=interval, save_cost_s=blocking_save_s, mtbf_s=needing,
        restart_overhead_s=restart_overhead / fallback_share,
    )  # fmt: skip
    return Projection(gpus, nodes, rate.name, nodes * rate.per_node_day, mtbf, interval, ettr)


def no_step_lost(measured: dict[System, Overhead]) -> dict[str, Any] | None:
    """The no-step-lost projection at the Llama 3 rate from bench-checkpoint's blocking ratio; None without it."""
    path = RESULTS_DIR / "checkpoint.json"
    peer = measured.get(System.PEER) or measured.get(System.FAST)
    fast = measured.get(System.FAST) or peer
    if not path.exists() or peer is None or fast is None:
        return None
    saved = json.loads(path.read_text(encoding="utf-8"))
    ratio = float(saved["figures"]["blocking_ratio"])
    blocking = SYNC_SAVE_MODEL_S * ratio
    llama = next(r for r in RATES if r.name == "Llama 3")

    def row(name: str, save: float, share: float, u0: float) -> dict[str, Any]:
        cells = [project_no_step_lost(gpus=g, rate=llama, blocking_save_s=save, fallback_share=share,
                                      restart_overhead=u0) for g in GPU_COUNTS]  # fmt: skip
        return {"name": name, "save_s": save, "fallback_share": share, "u0_s": u0, "cells": [asdict(c) for c in cells]}

    rows = [
        row("synchronous save, every failure from the checkpoint", SYNC_SAVE_MODEL_S, 1.0, fast.restart_overhead_s),
        row("background save, every failure from the checkpoint", blocking, 1.0, fast.restart_overhead_s),
        *(row(f"background save + peer recovery, f = {f:g}", blocking, f, peer.restart_overhead_s)
          for f in FALLBACK_SHARES if f < 1),
    ]  # fmt: skip
    return {
        "checkpoint_measured": saved["machine"]["date"],
        "blocking_ratio": ratio,
        "sync_save_model_s": SYNC_SAVE_MODEL_S,
        "blocking_save_s": round(blocking, 3),
        "u0_from": "peer" if System.PEER in measured else "fast (no peer cells yet)",
        "assumed_fallback_share": FALLBACK_SHARE,
        "rows": rows,
    }


def load(name: str | None = None) -> tuple[str, dict[str, Any]]:
    """The recovery results: the full run's, else the smoke run's."""
    for candidate in [name] if name else ["recovery", "recovery-quick"]:
        path = RESULTS_DIR / f"{candidate}.json"
        if path.exists():
            return candidate, json.loads(path.read_text(encoding="utf-8"))
    raise SystemExit("no bench/results/recovery.json nor recovery-quick.json: run make bench-recovery first")


def projections(measured: dict[System, Overhead], save_cost: float) -> dict[str, list[dict[str, Any]]]:
    """Every fleet size at every rate for every measured system, at one save cost."""
    return {
        system.value: [
            asdict(project(gpus=g, rate=r, save_cost=save_cost, restart_overhead=o.restart_overhead_s))
            for g in GPU_COUNTS
            for r in RATES
        ]
        for system, o in measured.items()
    }


def figures(source: str, document: dict[str, Any], save_cost: float | None = None) -> dict[str, Any]:
    """Every input and every projection, as saved in ettr.json."""
    cells = document["figures"]["cells"]
    measured = overheads(cells)
    delta = save_cost_s(cells) if save_cost is None else save_cost
    return {
        "source": f"bench/results/{source}.json",
        "source_measured": document["machine"]["date"],
        "source_quick": document["figures"]["quick"],
        "save_cost_s": delta,
        "save_cost_given": save_cost is not None,
        "gpus_per_node": GPUS_PER_NODE,
        "rates": [asdict(rate) for rate in RATES],
        "overheads": {s.value: asdict(o) for s, o in measured.items()},
        "missing_systems": [s.value for s in System if s not in measured],
        "projections": projections(measured, delta),
        "advisor_default_save_cost_s": DEFAULT_SAVE_COST_S,
        "projections_at_advisor_default": projections(measured, DEFAULT_SAVE_COST_S),
        "no_step_lost": no_step_lost(measured),
    }


def render(result: dict[str, Any], *, plots: bool = True) -> str:
    """The inputs, a table of ETTR per fleet size, rate and system, and a plot at the Llama 3 rate (Markdown)."""
    systems = [System(s) for s in result["projections"]]
    lines = [
        f"From `{result['source']}` ({'**smoke run, 1 fault per cell**' if result['source_quick'] else 'full run'},"
        f" measured {result['source_measured']}); checkpoint save cost δ = {result['save_cost_s']:.3f} s "
        f"({'given' if result['save_cost_given'] else 'the registry advisor measured it'}); "
        f"{result['gpus_per_node']} GPUs per node.",
        "",
    ]
    for system in systems:
        o = result["overheads"][system.value]
        kinds = ", ".join(f"{k} {v:.2f} s" for k, v in o["per_fault_s"].items())
        lines.append(f"- u0 {SYSTEM_NAMES[system]} = **{o['restart_overhead_s']:.2f} s** (mean of {kinds})")
        lines += [f"  - {kind}: estimated, {why}" for kind, why in o["estimated"].items()]
    lines += [f"- not measured: {SYSTEM_NAMES[System(s)]}" for s in result["missing_systems"]]
    default = result["projections_at_advisor_default"]
    only = None if plots else "Llama 3"  # the doc keeps one rate; the terminal and ettr.json have all three
    lines += ["", f"At the measured save cost, δ = {result['save_cost_s']:.3f} s:", "",
              _table(result["projections"], systems, only), *_plot_block(result["projections"], plots)]  # fmt: skip
    if plots:
        lines += [
            "", f"At the advisor's default save cost (what it assumes for a job with no measured checkpoint), "
            f"δ = {result['advisor_default_save_cost_s']:g} s:", "",
            _table(default, systems), *_plot_block(default, plots),
        ]  # fmt: skip
    return "\n".join([*lines, *_no_step_lost_block(result.get("no_step_lost"))])


def _no_step_lost_block(found: dict[str, Any] | None) -> list[str]:
    if not found:
        return ["", "No step lost: not projected (run make bench-checkpoint and make bench-recovery first)."]
    lines = [
        "",
        f"No step lost, at the Llama 3 rate, with a {found['sync_save_model_s']:g} s synchronous save: a background "
        f"save blocks {found['blocking_ratio']:.1%} of it (bench-checkpoint, {found['checkpoint_measured']}), "
        f"δb = {found['blocking_save_s']:.2f} s; u0 from the {found['u0_from']} cells; f is assumed "
        f"({found['assumed_fallback_share']:g}; the module docstring says why).", "",
        "| model | δ | f | u0 | " + " | ".join(f"ETTR {g:,} GPUs" for g in GPU_COUNTS) + " |",
        "|---|---|---|---|" + "---|" * len(GPU_COUNTS),
    ]  # fmt: skip
    for row in found["rows"]:
        ettrs = " | ".join(f"{c['ettr']:.2%}" for c in row["cells"])
        lines.append(
            f"| {row['name']} | {row['save_s']:.2f} s | {row['fallback_share']:g} | {row['u0_s']:.2f} s | {ettrs} |"
        )
    return lines


def _table(projected: dict[str, list[dict[str, Any]]], systems: list[System], rate: str | None = None) -> str:
    header = "| GPUs | failure rate | failures/day | job MTBF | advisor's interval | " + " | ".join(
        f"ETTR {SYSTEM_NAMES[s]}" for s in systems
    )
    rows = [header + " |", "|---" * (5 + len(systems)) + "|"]
    for index, p in enumerate(projected[systems[0].value]):
        if rate is not None and p["rate"] != rate:
            continue
        ettrs = " | ".join(f"{projected[s.value][index]['ettr']:.2%}" for s in systems)
        rows.append(
            f"| {p['gpus']:,} | {p['rate']} | {p['failures_per_day']:.1f} | {p['mtbf_s'] / 60:.1f} min | "
            f"{p['interval_s']:.1f} s | {ettrs} |"
        )
    return "\n".join(rows)


def _plot_block(projected: dict[str, list[dict[str, Any]]], plots: bool) -> list[str]:
    """The plot as a fenced block after its table (the terminal shows it; the doc keeps the table alone)."""
    return ["", "```", *_plot(projected), "```"] if plots else []


def _plot(projected: dict[str, list[dict[str, Any]]]) -> list[str]:
    """ETTR at the Llama 3 rate as horizontal bars from a floor (the lowest ETTR rounded down to 5 %) to 100 %."""
    llama = [(s, p) for s, ps in projected.items() for p in ps if p["rate"] == "Llama 3"]
    floor = min(0.95, int(min(p["ettr"] for _, p in llama) * 20) / 20)
    lines = [f"ETTR at the Llama 3 rate{'':>11}{floor:<{PLOT_WIDTH - 2}.0%}100%"]
    for gpus in GPU_COUNTS:
        for system, p in ((s, p) for s, p in llama if p["gpus"] == gpus):
            filled = round((p["ettr"] - floor) / (1 - floor) * PLOT_WIDTH)
            label = f"{gpus:>7,} GPUs, {SYSTEM_NAMES[System(system)]}"
            lines.append(f"{label:<34}|{'#' * filled}{' ' * (PLOT_WIDTH - filled)}| {p['ettr']:.2%}")
    return lines


def main() -> None:
    """Project, print, save, write into the doc."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--save-cost-s", type=float, help="a checkpoint save cost instead of the measured one")
    args = parser.parse_args()
    source, document = load()
    if source != "recovery":
        print("bench/results/recovery.json is missing: projecting from the smoke run, recovery-quick.json")
    print("\n\n".join((__doc__ or "").split("\n\n")[2:6]))
    result = figures(source, document, args.save_cost_s)
    text = render(result)
    print(text)
    print("saved", write_result("ettr", result))
    if args.save_cost_s is None and replace_block(DOC, BEGIN, END, render(result, plots=False)):
        print("updated docs/benchmarks.md")


if __name__ == "__main__":
    main()
