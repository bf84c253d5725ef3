"""A GPU running hot, on the real detector: node reports whose GPU stays hot (or thermally throttled) for several looks
are one warning incident naming the GPU, its temperature and how long; a cool GPU, or one hot at a single look, is
none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session, select

from reprise_common.clock import ManualClock, utcnow
from reprise_common.errors import ConfigError
from reprise_common.events import GpuStatus
from reprise_detector.classify import load_rules
from reprise_detector.incidents.models import Symptom
from reprise_detector.kinds.gpu_hot import GpuHotRule

Harness = Any  # tests/conftest.py
StartDetector = Any
JOB, NODE = "job-hot", "node-1"
LOOK_S = 5.0  # rules.yaml, gpu_hot.look_every_s


async def _start(start_detector: StartDetector, sqlite_url: str) -> tuple[Harness, ManualClock]:
    clock = ManualClock(utcnow())
    h = await start_detector(sqlite_url, clock=clock, watch_interval_s=3600, node_lost_after_s=3600)
    await h.place(JOB, [(0, NODE, 0), (1, NODE, 1)])
    return h, clock


async def _reports(h: Harness, clock: ManualClock, gpus: list[GpuStatus], count: int) -> None:
    """`count` reports of the node's GPUs, a look apart."""
    for _ in range(count):
        await h.report(NODE, gpus=gpus)
        await h.settled()
        clock.advance(LOOK_S)


def _hot_symptoms(h: Harness) -> list[Symptom]:
    with Session(h.runtime.engine) as session:
        return list(session.exec(select(Symptom).where(Symptom.kind == "gpu.hot")).all())


async def test_a_gpu_hot_for_three_looks_is_one_warning_naming_it(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    h, clock = await _start(start_detector, sqlite_url)
    cool = GpuStatus(index=0, temperature_c=61.0)
    throttled = GpuStatus(index=1, temperature_c=92.0, throttle_reasons=["hw_thermal_slowdown", "sw_power_cap"])
    await _reports(h, clock, [cool, throttled], 2)
    assert await h.open_incidents(JOB) == []  # hot at two looks: not yet
    await _reports(h, clock, [cool, throttled], 4)  # the third look says it; the next ones are the same spell
    [incident] = await h.open_incidents(JOB)
    assert (incident["category"], incident["severity"]) == ("gpu_hardware", "warning")
    assert incident["recommended_action"] == "none"
    assert (incident["culprit_node_id"], incident["culprit_gpu"], incident["culprit_rank"]) == (NODE, 1, 1)
    assert incident["root_cause"] == (
        f"GPU 1 on {NODE} running hot: 92 °C, throttled (hw_thermal_slowdown) for 10 s (3 looks in a row)"
    )
    [symptom] = _hot_symptoms(h)  # one symptom for the spell, however many hot reports follow
    assert (symptom.gpu, symptom.job_id) == (1, JOB)


async def test_a_cool_gpu_or_one_hot_at_a_single_look_is_no_symptom(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    h, clock = await _start(start_detector, sqlite_url)
    cool = [GpuStatus(index=0, temperature_c=61.0), GpuStatus(index=1, temperature_c=70.0, throttle_reasons=["idle"])]
    spike = [cool[0], GpuStatus(index=1, temperature_c=90.0)]
    for gpus in (cool, cool, spike, cool, cool, spike, cool, cool):  # never hot at two looks in a row
        await _reports(h, clock, gpus, 1)
    assert await h.open_incidents(JOB) == []
    assert _hot_symptoms(h) == []


def test_an_operators_rules_file_sets_what_counts_as_hot(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    rule = "category: gpu_hardware, severity: warning, action: alert_human, root_cause: true, reason: 'GPU {gpu} hot'"
    path.write_text("gpu_hot: {" + rule + ", hot_c: 80, looks: 2}")
    hot = load_rules(path).derived["gpu.hot"]
    assert isinstance(hot, GpuHotRule)
    assert (hot.hot_c, hot.looks, hot.look_every_s, hot.action) == (80, 2, 5.0, "alert_human")
    path.write_text("gpu_hot: {" + rule + ", looks: 0}")
    with pytest.raises(ConfigError, match=r"gpu_hot\.looks"):
        load_rules(path)
