"""The one typed adapter to Slurm's commands: `sbatch`, `squeue`, `sinfo`, `scontrol`, `scancel`.

Every call is an asyncio subprocess with a timeout, so a controller that does not answer is a `SlurmUnavailableError`
(a dependency failure with a clear message), never a hang. Reads use Slurm's machine-readable output: Slurm 22.05 has
`--json` on `sinfo` and `squeue` (both ignore their filters with it, so we filter here) but not on `scontrol` (added in
23.02), so nodes come from `sinfo --json` and jobs from `squeue --json`. Every argument is one `--key=value` or
`Key=value` token of a validated value, so no node name, reason or job name can smuggle in an option. The values and
their checks are models.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from reprise_common.errors import DependencyUnavailableError, RepriseError
from reprise_orchestrator.compute.slurm.models import (
    SlurmJob,
    SlurmJobState,
    SlurmNode,
    SlurmSubmission,
    plain_text,
    slurm_name,
)

DEFAULT_TIMEOUT_S = 10.0  # a dead controller fails a command in ~4 s (connect retries); a frozen one never does
_UNREACHABLE = (
    "unable to contact slurm controller",
    "socket timed out",
    "zero bytes were transmitted",
    "communication connection failure",
    "connection refused",
    "munge",  # no munged, or a credential it refused: Slurm cannot authenticate us to anything
    "configuration source",  # no slurm.conf (SLURM_CONF unset, no /etc/slurm/slurm.conf) and no DNS record of one
)
# What a batch submission's environment holds of the orchestrator's (sbatch passes its environment on to the job):
# never the orchestrator's secrets or settings, which the agents and the ranks must not see.
_SUBMIT_ENVIRONMENT = ("PATH", "HOME", "LANG", "LC_ALL", "USER", "LOGNAME", "TMPDIR")


class SlurmError(RepriseError):
    """Slurm refused or failed a command (an unknown node, an invalid job id, output we cannot read)."""


class SlurmUnavailableError(SlurmError, DependencyUnavailableError):
    """Slurm cannot be reached: the controller did not answer in time, a Slurm command is not installed, or there is
    no Slurm configuration (the API answers 503, naming the Slurm controller)."""

    dependency = "the Slurm controller"


def expand_hostlist(expression: str) -> tuple[str, ...]:
    """Slurm's compact node list as names: "node[1-3,5],gpu07" → node1, node2, node3, node5, gpu07."""
    names: list[str] = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]+)(?:\[([^\]]*)\])?([^,\[]*)", expression):
        if not ranges:
            names.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            names += [f"{prefix}{number:0{len(low)}d}{suffix}" for number in range(int(low), int(high or low) + 1)]
    return tuple(names)


class _WireModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _WireNode(_WireModel):
    name: str
    state: str
    state_flags: list[str] = []
    reason: str = ""
    reason_set_by_user: str | None = None

    def node(self) -> SlurmNode:
        state = frozenset({self.state.upper(), *(flag.upper() for flag in self.state_flags)})
        return SlurmNode(name=self.name, state=state, reason=self.reason, reason_set_by=self.reason_set_by_user)


class _WireAllocatedNode(_WireModel):
    nodename: str


class _WireResources(_WireModel):
    allocated_nodes: list[_WireAllocatedNode] = []


class _WireJob(_WireModel):
    job_id: int
    name: str = ""
    job_state: str
    nodes: str = ""
    state_reason: str = ""
    partition: str = ""
    restart_cnt: int = 0
    excluded_nodes: str = ""
    job_resources: _WireResources | None = None

    def job(self) -> SlurmJob:
        allocated = tuple(node.nodename for node in self.job_resources.allocated_nodes) if self.job_resources else ()
        state = self.job_state.upper()
        return SlurmJob(
            job_id=self.job_id,
            name=self.name,
            state=SlurmJobState(state) if state in SlurmJobState.__members__ else SlurmJobState.UNKNOWN,
            nodes=allocated or expand_hostlist(self.nodes),
            reason="" if self.state_reason == "None" else self.state_reason,
            partition=self.partition,
            restart_count=self.restart_cnt,
            excluded_nodes=expand_hostlist(self.excluded_nodes),
        )


class _WireOutput(_WireModel):
    errors: list[dict[str, object]] = []
    nodes: list[_WireNode] = []
    jobs: list[_WireJob] = []


class SlurmCli:
    """Slurm's commands, typed; `conf` (SLURM_CONF) picks the cluster, else the host's default configuration."""

    def __init__(self, *, conf: Path | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.conf = conf
        self.timeout_s = timeout_s

    async def reachable(self) -> bool:
        """True when the controller answers (scontrol ping)."""
        try:
            await self._run("scontrol", "ping")
        except SlurmError:
            return False
        return True

    async def nodes(self) -> list[SlurmNode]:
        """Every node of the cluster (sinfo --json)."""
        return [node.node() for node in (await self._read("sinfo")).nodes]

    async def node(self, name: str) -> SlurmNode:
        """One node; SlurmError when the cluster has none of that name."""
        name = _checked(slurm_name, name)
        for node in await self.nodes():
            if node.name == name:
                return node
        raise SlurmError(f"Slurm has no node {name!r}")

    async def jobs(self) -> list[SlurmJob]:
        """Every job the controller still knows, finished ones included until they age out (squeue --json)."""
        return [job.job() for job in (await self._read("squeue")).jobs]

    async def job(self, job_id: int) -> SlurmJob | None:
        """One job, or None when the controller does not know it (never submitted, or aged out)."""
        return next((job for job in await self.jobs() if job.job_id == job_id), None)

    async def submit(self, submission: SlurmSubmission) -> int:
        """Submit a batch allocation (sbatch --parsable, the script on stdin); returns its job id."""
        environment = {name: os.environ[name] for name in _SUBMIT_ENVIRONMENT if name in os.environ}
        out = await self._run("sbatch", *submission.argv(), stdin=submission.script, environment=environment)
        job_id = out.strip().split(";", 1)[0]  # "<id>" or "<id>;<cluster>"
        if not job_id.isdigit():
            raise SlurmError(f"sbatch answered no job id: {out.strip()[:200]!r}")
        return int(job_id)

    async def drain(self, node: str, *, reason: str) -> None:
        """Drain a node with a reason (visible in `sinfo -R`): Slurm places no new job on it."""
        node, reason = _checked(slurm_name, node), _checked(plain_text, reason)
        await self._run("scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}")

    async def resume(self, node: str) -> None:
        """Resume a drained (or down) node."""
        await self._run("scontrol", "update", f"NodeName={_checked(slurm_name, node)}", "State=RESUME")

    async def requeue(self, job_id: int, *, exclude: Sequence[str] = ()) -> None:
        """Requeue a job: its allocation ends and it waits to run again (after the cluster's cred_expire).

        With `exclude`, the job is requeued held, told the nodes it must not run on, then released: Slurm accepts an
        exclusion only while a job is pending, and a held job cannot start on an excluded node in between.
        """
        job = _job_id(job_id)
        if not exclude:
            await self._run("scontrol", "requeue", job)
            return
        names = ",".join(_checked(slurm_name, node) for node in exclude)
        await self._run("scontrol", "requeuehold", job)
        try:
            await self._run("scontrol", "update", f"JobId={job}", f"ExcNodeList={names}")
        finally:  # never leave the job held: a failed exclusion is raised, the job still runs again
            await self._run("scontrol", "release", job)

    async def cancel(self, job_id: int) -> None:
        """Cancel a job (scancel); cancelling a finished or unknown job is not an error."""
        await self._run("scancel", _job_id(job_id))

    async def _read(self, command: str) -> _WireOutput:
        out = await self._run(command, "--json")
        try:
            parsed = _WireOutput.model_validate_json(out)
        except ValidationError as exc:
            raise SlurmError(f"unreadable output of `{command} --json`: {exc.errors()[:1]}") from exc
        if parsed.errors:  # 22.05 exits 0 with an empty list and this when the controller does not answer
            raise SlurmUnavailableError(f"`{command} --json` got no answer from the Slurm controller: {parsed.errors}")
        return parsed

    async def _run(self, *argv: str, stdin: str | None = None, environment: dict[str, str] | None = None) -> str:
        """Run one Slurm command within the timeout (in `environment`, else ours); its stdout, or a SlurmError."""
        shown = " ".join(argv)
        env = dict(os.environ if environment is None else environment)
        if self.conf is not None:
            env["SLURM_CONF"] = str(self.conf)
        elif "SLURM_CONF" in os.environ:
            env["SLURM_CONF"] = os.environ["SLURM_CONF"]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
            )
        except FileNotFoundError as exc:
            raise SlurmUnavailableError(f"{argv[0]} not found: Slurm's client commands are not installed") from exc
        try:
            async with asyncio.timeout(self.timeout_s):
                out, err = await proc.communicate(stdin.encode() if stdin is not None else None)
        except TimeoutError:
            raise SlurmUnavailableError(
                f"the Slurm controller did not answer `{shown}` within {self.timeout_s:g} s"
            ) from None
        finally:
            if proc.returncode is None:  # timed out or cancelled: the command must not outlive the call
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if proc.returncode != 0:
            message = err.decode(errors="replace").strip() or out.decode(errors="replace").strip()
            failure = f"`{shown}` failed (exit {proc.returncode}): {message[:500]}"
            # Some commands misname a lost controller (`scontrol requeue`: "Unexpected message received"): ask it.
            if any(mark in message.lower() for mark in _UNREACHABLE) or (
                argv[1:2] != ("ping",) and not await self.reachable()
            ):
                raise SlurmUnavailableError(f"{failure} (the Slurm controller does not answer)")
            raise SlurmError(failure)
        return out.decode(errors="replace")


def _checked(check: Callable[[str], str], value: str) -> str:
    """A validated argument, or SlurmError: a bad node name or reason is refused before any command runs."""
    try:
        return check(value)
    except ValueError as exc:
        raise SlurmError(str(exc)) from None


def _job_id(job_id: int) -> str:
    if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id < 1:
        raise SlurmError(f"not a Slurm job id: {job_id!r}")
    return str(job_id)
