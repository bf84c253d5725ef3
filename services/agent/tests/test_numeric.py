"""The agent's watch of training metrics: NaN, infinities and spikes, once per rank and launch."""

from __future__ import annotations

import math

import pytest

from reprise_agent.numeric import NumericWatcher
from reprise_common.events import NumericKind, NumericWatch

WATCH = NumericWatch(metrics=["loss"], spike_z=8.0, window=50, min_samples=10)


def feed(watcher: NumericWatcher, values: list[float], *, watch: NumericWatch = WATCH, epoch: int = 0, first: int = 1):
    """Each value as the loss of one step from `first` on; the trips made, by step."""
    trips = {}
    for offset, value in enumerate(values):
        step = first + offset
        trip = watcher.observe(watch, job_id="j", rank=0, restart_epoch=epoch, step=step, metrics={"loss": value})
        if trip is not None:
            trips[step] = trip
    return trips


NOISY = [2.0 + 0.05 * math.sin(i) for i in range(30)]  # a loss wobbling around 2.0


@pytest.mark.parametrize(
    ("values", "step", "kind", "last_good"),
    [
        ([*NOISY[:5], float("nan")], 6, NumericKind.NAN, 5),
        ([*NOISY[:5], float("inf")], 6, NumericKind.INF, 5),
        ([*NOISY[:5], float("-inf")], 6, NumericKind.INF, 5),
        ([float("nan")], 1, NumericKind.NAN, None),  # the launch's first value: no good step known
        ([*NOISY, 9.0], 31, NumericKind.SPIKE, 30),
    ],
)
def test_a_bad_value_trips_at_its_step_with_the_last_good_step(
    values: list[float], step: int, kind: NumericKind, last_good: int | None
) -> None:
    trips = feed(NumericWatcher(), values)
    assert list(trips) == [step]
    assert (trips[step].kind, trips[step].last_good_step, trips[step].metric) == (kind, last_good, "loss")
    assert trips[step].value is None if kind is not NumericKind.SPIKE else trips[step].value == 9.0


def test_a_spike_carries_its_median_and_z_and_ordinary_noise_and_falls_do_not_trip() -> None:
    trips = feed(NumericWatcher(), [*NOISY, 2.1, 1.9, 0.5, 2.0, 9.0])
    assert list(trips) == [35]
    assert trips[35].median == pytest.approx(2.0, abs=0.05) and trips[35].z is not None and trips[35].z >= 8.0


def test_spikes_wait_for_enough_values_and_are_off_without_a_threshold() -> None:
    assert feed(NumericWatcher(), [*NOISY[:5], 50.0]) == {}  # 5 values < min_samples
    no_spikes = NumericWatch(metrics=["loss"])
    assert feed(NumericWatcher(), [*NOISY, 50.0], watch=no_spikes) == {}
    assert list(feed(NumericWatcher(), [*NOISY, float("nan")], watch=no_spikes)) == [31]


def test_a_rank_trips_once_per_launch_and_a_new_launch_starts_afresh() -> None:
    watcher = NumericWatcher()
    assert list(feed(watcher, [1.0, float("nan"), float("nan")])) == [2]  # NaN persists: one trip
    assert feed(watcher, [float("nan")], epoch=0, first=4) == {}
    assert list(feed(watcher, [1.0, 1.0, float("nan")], epoch=1, first=1)) == [3]
    assert feed(watcher, [float("nan")], epoch=0, first=9) == {}  # a rank of the old launch, still talking


def test_only_the_watched_metrics_count_and_forget_drops_a_job() -> None:
    watcher = NumericWatcher()
    lr_only = {"lr": float("nan")}
    assert watcher.observe(WATCH, job_id="j", rank=0, restart_epoch=0, step=1, metrics=lr_only) is None
    feed(watcher, [float("nan")], first=2)
    watcher.forget("j")
    assert list(feed(watcher, [float("nan")], first=3)) == [3]  # forgotten: the same launch may trip again


def test_min_samples_beyond_the_window_is_refused() -> None:
    with pytest.raises(ValueError, match="min_samples is larger than window"):
        NumericWatch(window=10, min_samples=20)
