"""Classification rules, table-driven: every XID row of REFERENCE.md, rank exits, lost GPUs, dependencies."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from reprise_common.errors import ConfigError
from reprise_common.events import (
    Category,
    ComputeSignal,
    ComputeSignalKind,
    DependencyFailed,
    GpuLost,
    GpuXid,
    NumericKind,
    RankExited,
    RankNumeric,
    RecommendedAction,
    Severity,
)
from reprise_detector.classify import Classification, load_rules
from reprise_detector.kinds import gpu_xid
from reprise_detector.kinds.node_lost import NodeLost
from reprise_detector.kinds.rank_exited import normalise_signal

HW, NVL, APP = Category.GPU_HARDWARE, Category.INTERCONNECT, Category.APPLICATION
CRIT, WARN, INFO = Severity.CRITICAL, Severity.WARNING, Severity.INFO
NONE, RESTART, EVICT, RESET, HUMAN = (
    RecommendedAction.NONE,
    RecommendedAction.RESTART_JOB,
    RecommendedAction.RESTART_EXCLUDE_NODE,
    RecommendedAction.RESET_GPU,
    RecommendedAction.ALERT_HUMAN,
)

# xid, category, severity, action, root-cause-grade -- one row per row of the XID table in REFERENCE.md
XID_TABLE = [
    (13, APP, CRIT, RESTART, True),
    (31, APP, CRIT, RESTART, True),
    (43, APP, INFO, NONE, False),
    (45, APP, INFO, NONE, False),
    (46, HW, CRIT, RESET, True),
    (48, HW, CRIT, EVICT, True),
    (61, HW, CRIT, EVICT, True),
    (62, HW, CRIT, EVICT, True),
    (63, HW, INFO, NONE, False),
    (64, HW, CRIT, EVICT, True),
    (74, NVL, CRIT, EVICT, True),
    (79, HW, CRIT, EVICT, True),
    (92, HW, WARN, NONE, False),
    (94, HW, CRIT, RESTART, True),
    (95, HW, CRIT, EVICT, True),
    (109, HW, CRIT, EVICT, True),
    (119, HW, CRIT, EVICT, True),
    (120, HW, CRIT, EVICT, True),
    (140, HW, CRIT, EVICT, True),
    *[(xid, NVL, CRIT, EVICT, True) for xid in range(144, 151)],
    (154, HW, WARN, HUMAN, False),
]


def _xid(xid: int, gpu: int = 2) -> GpuXid:
    return GpuXid(source="node-1", node_id="node-1", gpu=gpu, xid=xid)


def _exit(**fields: object) -> RankExited:
    return RankExited(source="node-1", node_id="node-1", job_id="job-a", rank=5, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("xid", "category", "severity", "action", "fatal"), XID_TABLE, ids=str)
def test_every_reference_xid(
    xid: int, category: Category, severity: Severity, action: RecommendedAction, fatal: bool
) -> None:
    got = load_rules().classify(_xid(xid))
    assert (got.category, got.severity, got.action, got.root_cause_grade) == (category, severity, action, fatal)
    assert got.reason.startswith(f"XID {xid} on GPU 2: ")


def test_the_rules_cover_exactly_the_reference_table() -> None:
    assert set(load_rules().rules(gpu_xid.KIND).xids) == {row[0] for row in XID_TABLE}


@pytest.mark.parametrize("xid", [0, 1, 44, 999])
def test_an_unknown_xid_is_an_unknown_warning(xid: int) -> None:
    got = load_rules().classify(_xid(xid))
    assert (got.category, got.severity, got.root_cause_grade) == (Category.UNKNOWN, WARN, False)
    assert str(xid) in got.reason


@pytest.mark.parametrize(
    ("fields", "category", "action", "fatal", "reason_has"),
    [
        ({"signal": "SIGKILL", "oom_killed": True, "exit_code": 137}, APP, RESTART, True, "OOM"),
        ({"exit_code": 137, "oom_killed": True}, APP, RESTART, True, "OOM"),
        ({"signal": "SIGSEGV"}, APP, RESTART, True, "segmentation fault"),
        ({"signal": "11"}, APP, RESTART, True, "segmentation fault"),
        ({"exit_code": 139}, APP, RESTART, True, "segmentation fault"),
        ({"exit_code": -11}, APP, RESTART, True, "segmentation fault"),
        ({"signal": "kill"}, Category.PROCESS_KILLED, RESTART, True, "SIGKILL"),
        (
            {"exit_code": -9, "log_tail": ["Connection reset by peer"]},
            Category.PROCESS_KILLED,
            RESTART,
            True,
            "SIGKILL",
        ),
        ({"exit_code": 1, "log_tail": ["Connection reset by peer"]}, APP, NONE, False, "lost its connection"),
        ({"exit_code": 1}, APP, RESTART, True, "exit code 1"),
        ({"signal": "SIGABRT"}, APP, RESTART, True, "signal SIGABRT"),
        ({"exit_code": 0}, APP, NONE, False, "cleanly"),
    ],
)
def test_rank_exits(
    fields: dict[str, object], category: Category, action: RecommendedAction, fatal: bool, reason_has: str
) -> None:
    got = load_rules().classify(_exit(**fields))
    assert (got.category, got.action, got.root_cause_grade) == (category, action, fatal)
    assert "rank 5" in got.reason and reason_has in got.reason


def test_peers_failing_alike_each_get_their_own_reason() -> None:
    rules = load_rules()  # one book for all: the rule a log tail chose is remembered
    gloo = ["Traceback (most recent call last):", "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534]"]
    nccl = ["torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970"]
    exits = [(3, gloo), (9, gloo), (4, nccl), (11, gloo), (12, [*gloo, "ValueError: bad batch"])]
    reasons = [
        rules.classify(RankExited(source="n", node_id="n", job_id="j", rank=r, exit_code=1, log_tail=t)).reason
        for r, t in exits
    ]
    assert reasons == [
        "rank 3 failed in gloo (exit code 1): a secondary symptom",
        "rank 9 failed in gloo (exit code 1): a secondary symptom",
        "rank 4 failed in NCCL (exit code 1): a secondary symptom",
        "rank 11 failed in gloo (exit code 1): a secondary symptom",
        "rank 12 failed in gloo (exit code 1): a secondary symptom",
    ]
    crashed = rules.classify(RankExited(source="n", node_id="n", job_id="j", rank=3, exit_code=1, log_tail=["boom"]))
    assert crashed.root_cause_grade and crashed.reason == "rank 3 failed: exit code 1"


def test_a_lost_gpu_is_fatal_hardware() -> None:
    got = load_rules().classify(GpuLost(source="n", node_id="n", gpu=3, reason="NVML_ERROR_GPU_IS_LOST"))
    assert got == Classification(HW, CRIT, EVICT, True, "GPU 3 lost: NVML_ERROR_GPU_IS_LOST")


def test_a_failed_dependency_is_a_dependency_root_cause() -> None:
    got = load_rules().classify(DependencyFailed(source="n", node_id="n", dependency="storage", detail="nfs timeout"))
    assert (got.category, got.action, got.root_cause_grade) == (Category.DEPENDENCY, HUMAN, True)
    assert got.reason == "dependency storage failed: nfs timeout"


def test_a_jobs_unreachable_rendezvous_master_is_only_evidence() -> None:
    event = DependencyFailed(
        source="n", node_id="node-2", dependency="rendezvous:job-a", detail="connection refused", job_id="job-a"
    )
    got = load_rules().classify(event)
    assert (got.category, got.action, got.root_cause_grade) == (Category.DEPENDENCY, RecommendedAction.NONE, False)
    assert got.reason == "node node-2 cannot reach the rendezvous master of job job-a: connection refused"


def test_an_operator_file_overrides_and_extends(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(
        """
xid:
  - xids: [13]
    meaning: on our fleet XID 13 means a bad GPU
    category: gpu_hardware
    severity: critical
    action: restart_exclude_node
    root_cause: true
  - xids: [200]
    meaning: a future XID
    category: gpu_hardware
    severity: warning
    action: alert_human
    root_cause: false
rank_exited:
  - when: {exit_code: 42}
    category: dependency
    severity: critical
    action: alert_human
    root_cause: true
    reason: "rank {rank} could not reach the data loader"
"""
    )
    rules = load_rules(path)
    assert rules.classify(_xid(13)).category == HW
    assert rules.classify(_xid(200)).action == HUMAN
    assert rules.classify(_xid(79)).category == HW  # built-in rows are kept
    assert rules.classify(_exit(exit_code=42)).reason == "rank 5 could not reach the data loader"
    assert rules.classify(_exit(exit_code=1)).category == APP


def _rule(reason: str) -> str:
    return "{category: unknown, severity: warning, action: alert_human, root_cause: true, reason: '" + reason + "'}"


def test_an_operator_file_replaces_each_section_it_gives_and_keeps_the_others(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(
        f"""
unknown_xid: {_rule("odd XID {xid}")}
gpu_lost: {_rule("GPU {gpu} gone")}
dependency_failed: {_rule("{dependency} down")}
rank_numeric: {_rule("numbers on rank {rank}")}
compute_signal:
  preempted: {_rule("ours: {job_id} preempted")}
node_lost: {_rule("{node_id} gone")}
"""
    )
    rules, builtin = load_rules(path), load_rules()
    ours = Classification(Category.UNKNOWN, WARN, HUMAN, True, "")
    preempted = ComputeSignal(source="o", backend="slurm", kind=ComputeSignalKind.PREEMPTED, job_id="job-a")
    numeric = RankNumeric(source="n", node_id="n", job_id="j", rank=2, metric="loss", kind=NumericKind.NAN, step=5)
    lost = NodeLost(
        event_id="l", time=datetime(2026, 1, 1, tzinfo=UTC), node_id="node-3", silent_s=9, limit_s=5, how=""
    )
    replaced = [
        (_xid(999), "odd XID 999"),
        (GpuLost(source="n", node_id="n", gpu=3), "GPU 3 gone"),
        (DependencyFailed(source="n", node_id="n", dependency="storage", detail="nfs"), "storage down"),
        (numeric, "numbers on rank 2"),
        (preempted, "ours: job-a preempted"),
        (lost, "node-3 gone"),
    ]
    for event, reason in replaced:
        assert rules.classify(event) == replace(ours, reason=reason)
    kept = [
        _xid(79),
        _exit(exit_code=1),
        preempted.model_copy(update={"kind": ComputeSignalKind.TIME_LIMIT}),
        DependencyFailed(source="n", node_id="n", dependency="rendezvous:j", detail="refused", job_id="j"),
    ]
    for event in kept:
        assert rules.classify(event) == builtin.classify(event)


_RULE = "category: unknown, severity: info, action: none"
BAD_FILES = [
    (
        "xid: [{xids: [13], meaning: x, category: cosmic_rays, severity: info, action: none, root_cause: false}]",
        "xid.0",
    ),
    ("gpu_lost: {" + _RULE + ", root_cause: true, reason: '{0}'}", "gpu_lost"),
    ("rank_exited: [{when: {exit_cod: 1}, " + _RULE + ", root_cause: false, reason: r}]", "exit_cod"),
    ("xid: [unclosed", "not valid YAML"),
    ("version: 2", "version"),
    ("rank_parked: {" + _RULE + ", root_cause: true, reason: r}", "rank_parked"),  # fixed in code: no section
    ("compute_signal: {evicted: {" + _RULE + ", root_cause: true, reason: r}}", "compute_signal.evicted"),
]


@pytest.mark.parametrize(("text", "message"), BAD_FILES)
def test_a_bad_operator_file_is_refused_with_where(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_rules(path)


@pytest.mark.parametrize(
    ("signal", "exit_code", "expected"),
    [
        ("SIGKILL", None, "SIGKILL"),
        ("kill", None, "SIGKILL"),
        ("9", None, "SIGKILL"),
        (None, 137, "SIGKILL"),
        (None, -15, "SIGTERM"),
        (None, 1, None),
        (None, None, None),
        (None, 200, None),
    ],
)
def test_signals_are_normalised(signal: str | None, exit_code: int | None, expected: str | None) -> None:
    assert normalise_signal(signal, exit_code) == expected


# error text -> the line that names a failed peer (rules marked peer_failure), None when none does
PEER_FAILURES = [
    ("RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4711", "Connection closed"),
    ("Traceback (most recent call last):\nConnectionResetError: [Errno 104] Connection reset by peer", "Errno 104"),
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited", "NCCL"),
    ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9) ran for 600000 ms", None),
    ("Fatal Python error: Segmentation fault", None),
    ("", None),
]


@pytest.mark.parametrize(("text", "names"), PEER_FAILURES)
def test_only_errors_that_name_a_failed_peer_are_evidence_against_a_silent_node(text: str, names: str | None) -> None:
    line = load_rules().peer_failure(text)
    if names is None:
        assert line is None
    else:
        assert line is not None and names in line and "\n" not in line


def test_every_template_section_of_the_rules_file_is_loaded_into_the_rule_book() -> None:
    from reprise_detector import kinds
    from reprise_detector.classify import RulesFile

    owned = [section for kind in kinds.wire().values() for section in kind.sections]
    owned += [kind.section for kind in kinds.kinds().values()]
    assert sorted(owned) == sorted(set(RulesFile.model_fields) - {"version"})  # every section is one kind's
    book = load_rules()
    assert set(book.wire) == set(kinds.wire()) and set(book.derived) == set(kinds.kinds())
    assert set(kinds.wire()) == {
        "gpu.xid",
        "gpu.lost",
        "rank.exited",
        "dependency.failed",
        "rank.stacks",
        "rank.numeric",
        "rank.parked",
        "compute.signal",
    }
