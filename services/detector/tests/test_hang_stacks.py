"""The stacks of a hung job's ranks: kept with the hang's incident, shown by the API, and naming the culprit."""

from __future__ import annotations

from typing import Any

from reprise_common.clock import utcnow
from reprise_common.events import RankStacks, StackFrame, ThreadStack
from reprise_detector.kinds.job_hung import JobHung
from reprise_detector.stacks import StackView, culprit, waits_in

# `Harness` (tests/conftest.py) is passed in as a fixture; conftest is not importable here.
Harness = Any
C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def _thread(*frames: tuple[str, str, int]) -> ThreadStack:
    return ThreadStack(thread_id=1, frames=[StackFrame(function=f, file=path, line=line) for f, path, line in frames])


IN_ALL_REDUCE = _thread(
    ("all_reduce", C10D, 2501),
    ("wrapper", "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", 81),
    ("train_step", "/jobs/train.py", 40),
)
IN_LOADER = _thread(("load_batch", "/jobs/train.py", 12), ("train_step", "/jobs/train.py", 38))


def _view(rank: int, threads: ThreadStack | None, *, state: str = "S", error: str = "") -> StackView:
    listed = [threads] if threads is not None else []
    top = f"{threads.frames[0].function} (x.py:1)" if threads is not None else ""
    return StackView(rank, f"node-{rank}", state, waits_in(listed), top, error)


def test_the_rank_outside_the_collective_the_others_wait_in_is_the_culprit() -> None:
    assert waits_in([IN_ALL_REDUCE]) == "all_reduce" and waits_in([IN_LOADER]) is None
    found = culprit([_view(0, IN_ALL_REDUCE), _view(1, IN_LOADER), _view(2, IN_ALL_REDUCE)])
    assert found is not None and (found.rank, found.node_id) == (1, "node-1")
    assert "load_batch" in found.reason and "all_reduce" in found.reason and "[0, 2]" in found.reason
    # A process the kernel holds is the culprit even when its stack is inside the collective too.
    held = culprit([_view(0, IN_ALL_REDUCE), _view(1, IN_ALL_REDUCE, state="T"), _view(2, IN_LOADER)])
    assert held is not None and held.rank == 1 and "stopped" in held.reason


def test_stacks_that_say_nothing_name_nobody() -> None:
    assert culprit([_view(0, IN_ALL_REDUCE), _view(1, IN_ALL_REDUCE)]) is None  # every rank waits alike
    assert culprit([_view(0, IN_LOADER), _view(1, IN_LOADER)]) is None  # no collective to compare with
    failed = _view(1, None, error="py-spy did not answer within 2 s")
    assert culprit([_view(0, IN_ALL_REDUCE), failed]) is None  # a rank not read is not blamed
    assert culprit([]) is None


def _stacks(node: str, rank: int, incident_id: str, thread: ThreadStack | None, **fields: Any) -> RankStacks:
    return RankStacks(
        source=node,
        node_id=node,
        job_id="job-h",
        rank=rank,
        restart_epoch=0,
        incident_id=incident_id,
        pid=1000 + rank,
        proc_state="S",
        threads=[thread] if thread is not None else [],
        **fields,
    )


def _hung(*, rank: int, ranks: list[int]) -> JobHung:
    """job-h hung at step 7, blaming `rank` on node-1 as the one that stopped first."""
    return JobHung(
        event_id=f"hang:job-h:{rank}:7:training",
        time=utcnow(),
        node_id="node-1",
        job_id="job-h",
        rank=rank,
        stalled_ranks=ranks,
        lagging_ranks=[],
        step=7,
        phase="training",
        stalled_s=12.0,
        limit_s=10.0,
        limit_reason="floor",
    )


async def test_stacks_join_the_hang_and_rename_its_culprit(detector: Harness) -> None:
    await detector.place("job-h", [(0, "node-1", 0), (1, "node-1", 1), (2, "node-2", 0)])
    await detector.runtime.detector.process_derived([_hung(rank=0, ranks=[0, 1, 2])])
    [opened] = await detector.open_incidents("job-h")
    assert opened["category"] == "hang" and opened["culprit_rank"] == 0 and opened["stacks_verdict"] == ""
    incident_id = opened["id"]

    first = _stacks("node-1", 0, incident_id, IN_ALL_REDUCE)
    await detector.emit("node-1", first)
    await detector.emit("node-1", first)  # a redelivered capture is kept once
    await detector.emit("node-1", _stacks("node-1", 1, incident_id, IN_ALL_REDUCE))
    await detector.settled()
    assert (await detector.incident(incident_id))["culprit_rank"] == 0  # nobody stands out yet

    await detector.emit("node-2", _stacks("node-2", 2, incident_id, IN_LOADER))
    # A node that runs no rank of the job cannot speak for it, even naming the incident.
    await detector.emit("node-9", _stacks("node-9", 1, incident_id, IN_LOADER))
    await detector.settled()
    detail = await detector.incident(incident_id)
    assert (detail["culprit_node_id"], detail["culprit_rank"], detail["culprit_gpu"]) == ("node-2", 2, 0)
    assert detail["stacks_verdict"].startswith("rank 2 on node-2: its stack is at load_batch (train.py:12)")
    assert [(s["node_id"], s["rank"], s["waits_in"]) for s in detail["stacks"]] == [
        ("node-1", 0, "all_reduce"),
        ("node-1", 1, "all_reduce"),
        ("node-2", 2, None),
    ]
    assert detail["stacks"][2]["threads"][0]["frames"][0] == {
        "function": "load_batch",
        "file": "/jobs/train.py",
        "line": 12,
    }
    kinds = [s["kind"] for s in detail["symptoms"]]
    assert kinds.count("rank.stacks") == 3 and all(
        s["decision"] == "suppress" for s in detail["symptoms"] if s["kind"] == "rank.stacks"
    )
    changes = await detector.changes("job-h")
    assert changes[-1].culprit.node_id == "node-2" and changes[-1].culprit.rank == 2
    assert [c.category.value for c in changes] == ["hang"] * len(changes)


async def test_a_capture_that_failed_is_kept_and_blames_nobody(detector: Harness) -> None:
    await detector.place("job-h", [(0, "node-1", 0), (1, "node-1", 1)])
    await detector.runtime.detector.process_derived([_hung(rank=1, ranks=[0, 1])])
    [opened] = await detector.open_incidents("job-h")
    failed = _stacks("node-1", 0, opened["id"], None, error="py-spy did not answer within 2 s")
    await detector.emit("node-1", failed)
    await detector.emit("node-1", _stacks("node-1", 1, opened["id"], IN_ALL_REDUCE))
    await detector.settled()
    detail = await detector.incident(opened["id"])
    assert detail["culprit_rank"] == 1 and detail["stacks_verdict"] == ""
    assert [s["error"] for s in detail["stacks"]] == ["py-spy did not answer within 2 s", ""]
    symptom = next(s for s in detail["symptoms"] if s["kind"] == "rank.stacks" and s["rank"] == 0)
    assert "not captured: py-spy did not answer" in symptom["detail"]
