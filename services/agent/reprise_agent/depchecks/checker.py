"""The checker: runs the configured checks and each job's rendezvous check concurrently, and reports their edges."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import assert_never

from reprise_agent.depchecks.probes import (
    BlockingRunner,
    DependencyCheckError,
    probe_disk,
    probe_docker,
    probe_http,
    probe_storage,
    probe_tcp,
)
from reprise_agent.depchecks.specs import (
    DependencyCheckSpec,
    DiskCheck,
    DockerCheck,
    HttpCheck,
    StorageCheck,
    TcpCheck,
    unique_names,
)
from reprise_common.clock import Clock
from reprise_common.errors import ConfigError


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One run of one check; ``detail`` says what was seen, for the operator."""

    name: str
    kind: str
    ok: bool
    detail: str
    duration_s: float


class DependencyChecker:
    """Runs the configured checks concurrently and turns their results into edges worth publishing."""

    def __init__(
        self,
        specs: Sequence[DependencyCheckSpec],
        *,
        clock: Clock,
        repeat_s: float = 60.0,
        rendezvous_timeout_s: float = 2.0,
        rendezvous_grace_s: float = 30.0,
    ) -> None:
        try:
            self.specs: list[DependencyCheckSpec] = unique_names(list(specs))
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        self.clock = clock
        self.repeat_s = repeat_s
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.rendezvous_grace_s = rendezvous_grace_s
        self._runner = BlockingRunner()
        self._rendezvous: dict[str, tuple[TcpCheck, float]] = {}  # job id -> (check, monotonic time it was set)
        self._failing: dict[str, float] = {}  # name -> monotonic time it was last reported
        self._latest: dict[str, CheckResult] = {}

    @property
    def failing(self) -> frozenset[str]:
        """Names of the checks currently reported as failing."""
        return frozenset(self._failing)

    def latest(self) -> list[CheckResult]:
        """The most recent result of every check run so far (for a health page or the node report)."""
        return list(self._latest.values())

    # --- static checks ----------------------------------------------------------------------------------------
    async def run_once(self) -> list[CheckResult]:
        """Run every configured check concurrently, each bounded by its own deadline."""
        results = await asyncio.gather(*(self._check(spec) for spec in self.specs))
        self._latest.update((result.name, result) for result in results)
        return list(results)

    async def poll(self) -> list[CheckResult]:
        """Run the checks; return new failures, failures due for a repeat, and recoveries (``ok=True``)."""
        return self._edges(await self.run_once())

    async def _check(self, spec: DependencyCheckSpec) -> CheckResult:
        started = self.clock.monotonic()
        deadline = spec.deadline_s()
        try:
            ok, detail = True, await self._probe(spec, deadline)
        except TimeoutError:
            ok, detail = False, f"no answer from {spec.target()} within {deadline:g} s"
        except DependencyCheckError as exc:
            ok, detail = False, str(exc)
        return CheckResult(spec.name, spec.kind, ok, detail, max(0.0, self.clock.monotonic() - started))

    async def _probe(self, spec: DependencyCheckSpec, deadline: float) -> str:
        if isinstance(spec, StorageCheck):
            path = spec.path
            return await self._runner.run(spec.name, lambda: probe_storage(path), timeout_s=deadline)
        if isinstance(spec, DiskCheck):
            return await self._runner.run(spec.name, lambda: probe_disk(spec), timeout_s=deadline)
        if isinstance(spec, TcpCheck):
            return await asyncio.wait_for(probe_tcp(spec.host, spec.port), deadline)
        if isinstance(spec, HttpCheck):
            return await asyncio.wait_for(probe_http(spec), deadline)
        if isinstance(spec, DockerCheck):
            return await asyncio.wait_for(probe_docker(spec), deadline)
        assert_never(spec)

    # --- rendezvous masters -----------------------------------------------------------------------------------
    def watched_rendezvous(self) -> list[str]:
        """The jobs whose rendezvous master is being watched."""
        return sorted(self._rendezvous)

    def set_rendezvous(self, job_id: str, host: str, port: int) -> None:
        """Watch the rendezvous master of a job running here (a relaunch replaces it and restarts the grace)."""
        self._forget(rendezvous_name(job_id))
        check = TcpCheck(name=rendezvous_name(job_id), host=host, port=port, timeout_s=self.rendezvous_timeout_s)
        self._rendezvous[job_id] = (check, self.clock.monotonic())

    def clear_rendezvous(self, job_id: str) -> None:
        """Stop watching a job's rendezvous master (the job stopped or moved); its failure state is dropped."""
        self._rendezvous.pop(job_id, None)
        self._forget(rendezvous_name(job_id))

    async def run_rendezvous(self) -> list[CheckResult]:
        """TCP-check every watched rendezvous master concurrently."""
        results = await asyncio.gather(*(self._check(check) for check, _ in self._rendezvous.values()))
        self._latest.update((result.name, result) for result in results)
        return list(results)

    async def poll_rendezvous(self) -> list[CheckResult]:
        """Edges of the rendezvous checks; a master younger than the grace may still be starting, so is not blamed."""
        now = self.clock.monotonic()
        starting = {check.name for check, since in self._rendezvous.values() if now - since < self.rendezvous_grace_s}
        return self._edges(r for r in await self.run_rendezvous() if r.ok or r.name not in starting)

    # --- edges ------------------------------------------------------------------------------------------------
    def _edges(self, results: Iterable[CheckResult]) -> list[CheckResult]:
        now = self.clock.monotonic()
        edges: list[CheckResult] = []
        for result in results:
            last_reported = self._failing.get(result.name)
            if result.ok:
                if last_reported is not None:
                    del self._failing[result.name]
                    edges.append(result)
            elif last_reported is None or now - last_reported >= self.repeat_s:
                self._failing[result.name] = now
                edges.append(result)
        return edges

    def _forget(self, name: str) -> None:
        self._failing.pop(name, None)
        self._latest.pop(name, None)


_RENDEZVOUS = "rendezvous:"


def rendezvous_name(job_id: str) -> str:
    """The dependency name of a job's rendezvous master, as it appears in events."""
    return f"{_RENDEZVOUS}{job_id}"


def rendezvous_job(name: str) -> str | None:
    """The job whose rendezvous master a dependency name stands for; None for any other dependency."""
    return name.removeprefix(_RENDEZVOUS) if name.startswith(_RENDEZVOUS) else None
