"""A hang's incident page shows the ranks' Python stacks and the detector's verdict; other incidents show none.

The detector is served over real HTTP by a small app that answers `GET /v1/incidents/{id}` in the detector's shape
(stacks included, or left out as a detector from before stack captures does); the orchestrator is down.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

# `IncidentPage` (tests/conftest.py) is passed in as a fixture; conftest is not importable here.
IncidentPage = Callable[[dict[str, Any]], Awaitable[str]]
HOSTILE = "<script>alert(1)</script>"
VERDICT = f"rank 1 on node-2: its stack is at {HOSTILE} (train.py:12), not in all_reduce where ranks [0] wait"
_STACKS_SECTION = re.compile(r'<section id="stacks"[^>]*>.*?</section>', re.DOTALL)


def _incident(**fields: Any) -> dict[str, Any]:
    """An incident detail as the detector answers it."""
    return {
        "id": "inc-h1", "job_id": "job-1", "state": "open", "category": "hang", "severity": "critical",
        "root_cause": "no step progress for 60 s", "culprit_node_id": "node-2", "culprit_gpu": None,
        "culprit_rank": 1, "culprit_exit_code": None, "culprit_restart_epoch": 0, "recommended_action": "restart_job",
        "symptom_count": 1, "first_symptom_at": "2026-01-01T12:00:00Z", "opened_at": "2026-01-01T12:01:00Z",
        "updated_at": "2026-01-01T12:01:00Z", "resolved_at": None, "root_cause_at": "2026-01-01T12:00:00Z",
        "acknowledged_at": None, "symptoms": [], **fields,
    }  # fmt: skip


def _frame(function: str, file: str, line: int | None) -> dict[str, Any]:
    return {"function": function, "file": file, "line": line}


def _rank(rank: int, node_id: str, **fields: Any) -> dict[str, Any]:
    """One rank's stacks as the detector stored them."""
    return {
        "id": f"stk-{rank}", "incident_id": "inc-h1", "job_id": "job-1", "node_id": node_id, "rank": rank,
        "restart_epoch": 0, "pid": 4200 + rank, "proc_state": "S", "waits_in": None, "error": "",
        "capture_ms": 41.7, "captured_at": "2026-01-01T12:01:02Z", "threads": [], **fields,
    }  # fmt: skip


STACKS = [
    _rank(
        1, "node-2", proc_state="T",
        threads=[
            {"thread_id": 11, "name": "MainThread", "active": True, "frames": [
                _frame(HOSTILE, "train.py", 12), _frame("train_step", "train.py", 40),
                _frame("<module>", "train.py", None),
            ]},
            {"thread_id": 12, "name": "pin_memory", "active": False, "frames": [_frame("get", "queue.py", 180)]},
        ],
    ),
    _rank(
        0, "node-1", waits_in="all_reduce",
        threads=[{"thread_id": 1, "name": "MainThread", "active": False, "frames": [
            _frame("all_reduce", "torch/distributed/distributed_c10d.py", 2050), _frame("train_step", "train.py", 41),
        ]}],
    ),
    _rank(2, "node-3", pid=None, proc_state="", error="py-spy did not answer within 2 s", capture_ms=2000.0),
]  # fmt: skip


async def test_a_hang_shows_each_ranks_stack_in_rank_order_escaped(
    incident_page: IncidentPage,
) -> None:
    page = await incident_page(_incident(stacks_verdict=VERDICT, stacks=STACKS))
    [section] = _STACKS_SECTION.findall(page)
    assert "<h2>Stacks</h2>" in section and " hidden" not in section.split(">", 1)[0]
    assert HOSTILE not in page and "<script>alert" not in page  # escaped everywhere, the verdict included
    assert "its stack is at &lt;script&gt;alert(1)&lt;/script&gt; (train.py:12)" in section
    assert re.findall(r'data-rank="(\d+)"', section) == ["0", "1", "2"]

    ranks = dict(zip(["0", "1", "2"], re.split(r'<article class="rank-stacks"', section)[1:], strict=True))
    assert 'on <a href="/incidents?node_id=node-1">node-1</a>' in ranks["0"]
    assert (
        "pid 4200" in ranks["0"]
        and "state S (sleeping)" in ranks["0"]
        and "waits in <code>all_reduce</code>" in ranks["0"]
    )
    assert "41.7 ms" not in ranks["0"] and "in 42 ms" in ranks["0"] and "2026-01-01 12:01:02 UTC" in ranks["0"]
    main_frames = re.search(r'<pre class="log stack">(.*?)</pre>', ranks["1"], re.DOTALL)
    assert main_frames is not None
    assert main_frames.group(1).splitlines() == [
        "&lt;script&gt;alert(1)&lt;/script&gt; (train.py:12)",
        "train_step (train.py:40)",
        "&lt;module&gt; (train.py)",
    ]  # innermost first; a frame without a line shows its file alone
    assert "state T (stopped)" in ranks["1"] and "waits in" not in ranks["1"]
    [other] = re.findall(r"<details>(.*?)</details>", ranks["1"], re.DOTALL)  # other threads folded away
    assert "thread pin_memory · 1 frame<" in other and "get (queue.py:180)" in other
    assert "No stack: py-spy did not answer within 2 s" in ranks["2"] and "<pre" not in ranks["2"]
    assert "pid" not in ranks["2"] and "state" not in ranks["2"]


async def test_an_incident_without_stacks_shows_no_stacks_section(
    incident_page: IncidentPage,
) -> None:
    older = _incident(category="gpu_hardware")  # a detector from before stack captures: neither field
    for detail in (older, _incident(stacks_verdict="", stacks=[])):
        page = await incident_page(detail)
        assert "no step progress for 60 s" in page  # the incident itself renders
        [section] = _STACKS_SECTION.findall(page)
        assert section == '<section id="stacks" data-live hidden></section>'  # a slot a live refresh can fill
        assert "<h2>Stacks</h2>" not in page
