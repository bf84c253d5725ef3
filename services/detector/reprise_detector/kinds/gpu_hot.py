"""gpu.hot: a GPU running hot (at or above its rule's temperature, or slowed by a thermal throttle) at several looks at
its node's reports in a row.

Produced here, from the GPUs agents report (GpuStatus.temperature_c, throttle_reasons); classified by the `gpu_hot`
section of rules.yaml, which also holds its thresholds (a warning: the job goes on, slower; an operator decides when
to drain the node); it counts for every job placed on the node, the rank on that GPU blamed. Said once a hot spell:
a GPU that cools and heats up again is a new one.

A node's GPUs are read at most every `look_every_s` (most reports repeat them, and decoding every report's GPUs would
cost the ingest path at 20,000 reports a second), so a spell of `looks` looks lasts at least (looks - 1) x that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import msgspec
from pydantic import Field

from reprise_common.clock import Clock
from reprise_detector.kinds.base import Derived, Producer, Quiet, ReportView, Scope, TemplateRule

THERMAL = "thermal"  # in a throttle reason's name (NVML's hw_thermal_slowdown, sw_thermal_slowdown): slowed by heat


class GpuHotRule(TemplateRule):
    """The `gpu_hot` section: a classification and what counts as hot."""

    hot_c: float = Field(default=87.0, gt=0, description="a GPU at or above this temperature is hot")
    looks: int = Field(default=3, ge=1, description="hot at this many looks in a row: a symptom")
    look_every_s: float = Field(default=5.0, ge=0, description="a node's GPUs are looked at at most this often")


class GpuHot(Derived):
    """A GPU hot at `looks` looks in a row, for `hot_s` seconds so far."""

    section = "gpu_hot"
    rule = GpuHotRule

    type: Literal["gpu.hot"] = "gpu.hot"
    gpu: int
    temperature_c: float | None
    throttle_reasons: list[str]
    hot_s: float
    looks: int

    def facts(self) -> dict[str, Any]:
        """Its temperature, its thermal throttle (if any) and how long it has been hot, as a reason reads them."""
        heat = "temperature unknown" if self.temperature_c is None else f"{self.temperature_c:g} °C"
        thermal = [r for r in self.throttle_reasons if THERMAL in r]
        return {
            "temperature": heat,
            "throttled": f", throttled ({', '.join(thermal)})" if thermal else "",
            "hot_s": f"{self.hot_s:.0f}",
        }

    def detail(self) -> str:
        """Its readings and the spell."""
        facts = self.facts()
        readings = f"{facts['temperature']}{facts['throttled']}"
        return f"GPU {self.gpu}: {readings}; hot for {facts['hot_s']} s, {self.looks} looks"

    def scope(self) -> Scope:
        """Its GPU: every job placed on the node, the rank on it blamed."""
        return Scope(gpu=self.gpu)

    @classmethod
    def producer(cls, *, clock: Clock, rule: TemplateRule) -> Producer | None:
        """Its own producer, reading node reports."""
        return HeatWatch(clock=clock, rule=rule if isinstance(rule, GpuHotRule) else GpuHotRule(**rule.model_dump()))


class _GpuHeat(msgspec.Struct, frozen=True, gc=False):
    """What this kind reads of one GPU in a report (GpuStatus)."""

    index: int
    temperature_c: float | None = None
    throttle_reasons: tuple[str, ...] = ()


_GPUS = msgspec.json.Decoder(tuple[_GpuHeat, ...])


@dataclass
class _Spell:
    """A GPU hot since `began` (monotonic; `began_at` on the detector's clock), at `looks` looks in a row."""

    began: float
    began_at: datetime
    looks: int = 0
    said: bool = False


class HeatWatch(Quiet):
    """Producer: looks at each node's GPUs at most every `look_every_s`; a GPU hot at `looks` looks in a row is said
    once, until it cools."""

    reads_reports = True

    def __init__(self, *, clock: Clock, rule: GpuHotRule) -> None:
        self.clock = clock
        self.rule = rule
        self._next_look: dict[str, float] = {}  # node -> when its GPUs are looked at next (monotonic)
        self._spells: dict[str, dict[int, _Spell]] = {}  # node -> hot GPU -> its spell

    def on_report(self, node_id: str, report: ReportView, now: float) -> Sequence[Derived]:
        """The GPUs of the node that became hot enough for long enough at this look."""
        if now < self._next_look.get(node_id, float("-inf")):
            return ()
        self._next_look[node_id] = now + self.rule.look_every_s
        try:
            gpus = _GPUS.decode(report.gpus)
        except msgspec.DecodeError:  # counted as malformed by liveness, which reads the same GPUs
            return ()
        spells = self._spells.get(node_id, {})
        hot = {gpu.index: gpu for gpu in gpus if self._hot(gpu)}
        self._spells[node_id] = spells = {i: spells.get(i) or _Spell(now, self.clock.now()) for i in hot}
        if not spells:
            del self._spells[node_id]
        found: list[Derived] = []
        for index, spell in spells.items():
            spell.looks += 1
            if spell.looks >= self.rule.looks and not spell.said:
                spell.said = True
                found.append(self._finding(node_id, hot[index], spell, now))
        return found

    def _hot(self, gpu: _GpuHeat) -> bool:
        hot = gpu.temperature_c is not None and gpu.temperature_c >= self.rule.hot_c
        return hot or any(THERMAL in reason for reason in gpu.throttle_reasons)

    def _finding(self, node_id: str, gpu: _GpuHeat, spell: _Spell, now: float) -> GpuHot:
        return GpuHot(
            event_id=f"gpu-hot:{node_id}:{gpu.index}:{spell.began_at.isoformat()}"[:128],
            time=self.clock.now(),
            node_id=node_id,
            gpu=gpu.index,
            temperature_c=gpu.temperature_c,
            throttle_reasons=list(gpu.throttle_reasons),
            hot_s=now - spell.began,
            looks=spell.looks,
        )


KIND = GpuHot
