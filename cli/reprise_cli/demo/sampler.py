"""Rank 0's training step over time, read from its node's agent (GET /v1/status) in a background thread."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime

import httpx

from reprise_common.clock import utcnow


@dataclass(frozen=True)
class Sample:
    """Rank 0 at one moment: its launch (restart epoch) and the last step it completed (None before the first)."""

    at: datetime
    epoch: int
    step: int | None


class StepSampler:
    """Polls the agent that runs rank 0; the scenario points it at the new node after a recovery moves rank 0.

    The agent's status is live (the SDK's heartbeats reach it at once), unlike node reports, which come every second.
    """

    def __init__(self, *, job_id: str, interval_s: float = 0.2) -> None:
        self.job_id = job_id
        self.interval_s = interval_s
        self.agent_url: str | None = None
        self._samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-step-sampler", daemon=True)

    def start(self) -> None:
        """Start polling."""
        self._thread.start()

    def stop(self) -> None:
        """Stop polling and wait for the thread."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def samples(self) -> list[Sample]:
        """Every sample so far, oldest first."""
        with self._lock:
            return list(self._samples)

    def latest(self) -> Sample | None:
        """The newest sample, if any."""
        with self._lock:
            return self._samples[-1] if self._samples else None

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as http:
            while not self._stopping.wait(self.interval_s):
                sample = self._sample(http)
                if sample is not None:
                    with self._lock:
                        self._samples.append(sample)

    def _sample(self, http: httpx.Client) -> Sample | None:
        url = self.agent_url
        if url is None:
            return None
        try:
            ranks = http.get(f"{url}/v1/status").raise_for_status().json()["ranks"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None  # the node is being replaced, or lost: nothing to read this time
        rank0 = next((r for r in ranks if r.get("job_id") == self.job_id and r.get("rank") == 0), None)
        if rank0 is None or rank0.get("restart_epoch") is None:
            return None
        return Sample(at=utcnow(), epoch=int(rank0["restart_epoch"]), step=rank0.get("step"))


def last_step(samples: list[Sample], *, epoch: int) -> int | None:
    """The last step rank 0 completed in one launch (steps only grow within a launch)."""
    steps = [s.step for s in samples if s.epoch == epoch and s.step is not None]
    return max(steps) if steps else None


def reached(samples: list[Sample], *, step: int, after: datetime, epoch: int) -> datetime | None:
    """When rank 0 of a later launch first stood at `step` or beyond after `after` (None: not yet)."""
    return next(
        (s.at for s in samples if s.at >= after and s.epoch >= epoch and s.step is not None and s.step >= step), None
    )
