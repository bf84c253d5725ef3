"""Ranks in containers through the Docker Engine API: one container per rank on the host's network, its SDK socket,
inbox and checkpoint directories mounted, its limits from the job's ContainerSpec (docs/containers.md).

The container runs Docker's init (tini) as its pid 1 and the rank's command as its child: a signal from the host
reaches the rank like a process's signal would, and the rank's exit code comes back as tini's (128 + the signal for a
signal death, as a shell reports it). The rank's handle names the command's process as the host sees it, so that
reports, /proc samples and py-spy work on it as on a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import signal
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
import docker.types
from docker.models.containers import Container

from reprise_agent.launch.container_policy import ContainerPolicy, DockerUnavailableError, LaunchRefusedError
from reprise_agent.launch.container_procs import SIGNAL_EXIT_BASE, descendants, exit_code, namespace_pid, rank_pid
from reprise_agent.launch.processes import io_chars
from reprise_common.events import ContainerSpec, LaunchArgs
from reprise_common.logging import get_logger
from reprise_common.procs import ProcessSample, sample_process, start_ticks

log = get_logger("reprise.agent.containers")

LABEL = "io.reprise"  # every label of ours starts with it: <LABEL>.node, .job, .epoch, .rank


@dataclass
class ContainerHandle:
    """One rank's container: its output, exit and signals, through its init's pid and the daemon."""

    container: Container
    init_pid: int
    pid: int
    inbox: Path | None = None  # the host directory mounted as the rank's inbox directory (removed with it)
    inbox_link: Path | None = None  # <inbox dir>/<pid>.sock, pointing at the socket the SDK binds in the container
    warm: bool = False
    returncode: int | None = None
    oom: bool = False
    output: asyncio.StreamReader = field(init=False)
    _exited: asyncio.Event = field(init=False)

    def __post_init__(self) -> None:
        self.started = start_ticks(self.pid)
        self.init_started = start_ticks(self.init_pid)

    def follow(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the threads that copy its output and wait for its exit (the SDK's calls block); on the loop."""
        self.output = asyncio.StreamReader()
        self._exited = asyncio.Event()
        pump = threading.Thread(target=self._pump, args=(loop,), name=f"ctr-out-{self.pid}", daemon=True)
        pump.start()
        threading.Thread(target=self._wait, args=(loop, pump), name=f"ctr-wait-{self.pid}", daemon=True).start()

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            for chunk in self.container.logs(stream=True, follow=True, stdout=True, stderr=True):
                loop.call_soon_threadsafe(self.output.feed_data, chunk)
        except (docker.errors.DockerException, OSError) as exc:
            log.warning("container output lost", extra={"container": self.container.short_id, "error": str(exc)})
        finally:
            loop.call_soon_threadsafe(self.output.feed_eof)

    def _wait(self, loop: asyncio.AbstractEventLoop, pump: threading.Thread) -> None:
        try:
            status = int(self.container.wait()["StatusCode"])
            self.container.reload()
            self.oom = bool(self.container.attrs["State"].get("OOMKilled"))
        except (docker.errors.DockerException, OSError) as exc:  # the daemon went away: its init tells the end
            log.warning("docker lost a container", extra={"container": self.container.short_id, "error": str(exc)})
            while start_ticks(self.init_pid) == self.init_started and self.init_started is not None:
                threading.Event().wait(0.2)
            status = SIGNAL_EXIT_BASE + signal.SIGKILL
        pump.join(timeout=5.0)
        with contextlib.suppress(docker.errors.DockerException, OSError):
            self.container.remove(force=True)
        self._forget_inbox()
        loop.call_soon_threadsafe(self._exit, exit_code(status))

    def _exit(self, returncode: int) -> None:
        self.returncode = returncode
        self._exited.set()

    def _forget_inbox(self) -> None:
        if self.inbox_link is not None:
            with contextlib.suppress(OSError):
                self.inbox_link.unlink()
        if self.inbox is not None:
            shutil.rmtree(self.inbox, ignore_errors=True)

    async def wait(self) -> int:
        """Wait for the container's exit; its code as a process's (negative: a signal)."""
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def signal(self, sig: int) -> None:
        """SIGKILL: the whole container. Another signal: every process of the rank (not its init, which would pass
        it on again), as a process group would get it; nothing once the container's init is gone."""
        if sig == signal.SIGKILL:
            self.kill()
            return
        if start_ticks(self.init_pid) != self.init_started or self.init_started is None:
            return
        for pid in list(descendants(self.init_pid)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def terminate(self) -> None:
        """SIGTERM, then SIGCONT (a frozen rank must run to handle its SIGTERM)."""
        self.signal(signal.SIGTERM)
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        """Kill the container: its init dies, and with it every process in its pid namespace."""
        if self._exited.is_set():
            return
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
            self.container.kill()

    def oom_killed(self) -> bool:
        """The daemon's word: the container's memory cgroup hit its limit and the kernel killed in it."""
        return self.oom

    def usage(self) -> ProcessSample | None:
        """The rank process's state and CPU time from /proc."""
        return sample_process(self.pid) if start_ticks(self.pid) == self.started else None

    def io_bytes(self) -> int | None:
        """The rank process's system-call I/O from /proc."""
        return io_chars(self.pid) if start_ticks(self.pid) == self.started else None

    def record(self) -> dict[str, Any]:
        """The container's id: a later agent removes it; the pid and start time for reports."""
        return {"pid": self.pid, "started": self.started, "container_id": self.container.id}


def _labels(env: Mapping[str, str]) -> dict[str, str]:
    names = {"node": "REPRISE_NODE_ID", "job": "REPRISE_JOB_ID", "epoch": "REPRISE_RESTART_EPOCH", "rank": "RANK"}
    return {f"{LABEL}.{label}": env.get(var, "") for label, var in names.items()}


def _name(env: Mapping[str, str]) -> str:
    raw = f"reprise-{env.get('REPRISE_JOB_ID', 'job')}-e{env.get('REPRISE_RESTART_EPOCH', '0')}-r{env.get('RANK', 'x')}"
    return re.sub(r"[^a-zA-Z0-9_.-]", "_", raw)[:200] + "-" + secrets.token_hex(3)


def _bind(source: str | Path, target: str | Path | None = None, *, read_only: bool) -> docker.types.Mount:
    return docker.types.Mount(str(target or source), str(source), type="bind", read_only=read_only)


class ContainerLauncher:
    """Starts one job's ranks, each in a container of the job's image (a Launcher)."""

    def __init__(self, engine: ContainerEngine, spec: LaunchArgs) -> None:
        assert spec.container is not None
        self.engine = engine
        self.job = spec
        self.spec: ContainerSpec = spec.container

    async def start(
        self, argv: Sequence[str], *, env: Mapping[str, str], cwd: str | None, warm: bool
    ) -> ContainerHandle:
        """Create and start the rank's container; warm standbys do not serve containers (`warm` is ignored)."""
        inbox = self._inbox_dir(env)
        try:
            container, init_pid, pid = await asyncio.to_thread(self._run, list(argv), dict(env), cwd, inbox)
        except BaseException:
            if inbox is not None:
                shutil.rmtree(inbox, ignore_errors=True)
            raise
        handle = ContainerHandle(container, init_pid=init_pid, pid=pid, inbox=inbox)
        handle.inbox_link = self._link_inbox(pid, inbox)
        handle.follow(asyncio.get_running_loop())
        return handle

    def _link_inbox(self, pid: int, inbox: Path | None) -> Path | None:
        """``<inbox dir>/<pid>.sock``, where the supervisor sends a rank's orders, made to point at the socket the SDK
        binds in the container (named by its pid in there)."""
        inner = namespace_pid(pid)
        if inbox is None or self.engine.inbox_dir is None or inner is None:
            return None
        link = self.engine.inbox_dir / f"{pid}.sock"
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        link.symlink_to(inbox.relative_to(self.engine.inbox_dir) / f"{inner}.sock")
        return link

    def _inbox_dir(self, env: Mapping[str, str]) -> Path | None:
        """A host directory of its own to mount as the rank's inbox directory: the SDK names its inbox by its pid in
        the container, which another container's rank may share."""
        if self.engine.inbox_dir is None or not env.get("REPRISE_SDK_INBOX_DIR"):
            return None
        path = self.engine.inbox_dir / "containers" / secrets.token_hex(6)
        path.mkdir(mode=0o700, parents=True)
        return path

    def _run(
        self, argv: list[str], env: dict[str, str], cwd: str | None, inbox: Path | None
    ) -> tuple[Container, int, int]:
        """Create and start the container (blocking calls: in a thread); its init's pid and the rank's."""
        if self.job.checkpoints is not None:  # a bind's source must exist; a job's first launch has saved nothing yet
            try:
                Path(self.job.checkpoints.directory).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise LaunchRefusedError(f"checkpoints.directory could not be created: {exc}") from exc
        created = self._create(argv, env, cwd, inbox)
        try:
            created.start()
            created.reload()
            init_pid = int(created.attrs["State"]["Pid"])
        except docker.errors.APIError as exc:
            with contextlib.suppress(docker.errors.DockerException):
                created.remove(force=True)
            raise LaunchRefusedError(f"the Docker daemon refused to start the container: {exc.explanation}") from exc
        except (docker.errors.DockerException, OSError) as exc:
            raise DockerUnavailableError(f"the Docker daemon did not answer: {exc}") from exc
        return created, init_pid, rank_pid(init_pid)

    def _create(self, argv: list[str], env: dict[str, str], cwd: str | None, inbox: Path | None) -> Container:
        try:
            return self.engine.client().containers.create(
                self.spec.image, argv, **self._options(env, cwd, inbox), detach=True
            )
        except docker.errors.ImageNotFound as exc:
            raise LaunchRefusedError(
                f"container.image {self.spec.image!r} is not on this node (images are never pulled): {exc.explanation}"
            ) from exc
        except docker.errors.APIError as exc:
            raise LaunchRefusedError(f"the Docker daemon refused the rank's container: {exc.explanation}") from exc
        except (docker.errors.DockerException, OSError) as exc:
            raise DockerUnavailableError(f"the Docker daemon did not answer: {exc}") from exc

    def _options(self, env: dict[str, str], cwd: str | None, inbox: Path | None) -> dict[str, Any]:
        spec, options = self.spec, dict[str, Any]()
        if spec.memory_bytes is not None:  # no swap beyond the limit: over it, the kernel's OOM killer acts
            options |= {"mem_limit": spec.memory_bytes, "memswap_limit": spec.memory_bytes}
        if spec.cpus is not None:
            options["nano_cpus"] = int(spec.cpus * 1e9)
        if spec.shm_bytes is not None:
            options["shm_size"] = spec.shm_bytes
        gpu = env.get("CUDA_VISIBLE_DEVICES")
        if self.engine.gpus and gpu:  # the one GPU the rank was given is the only one it sees: device 0 in there
            options["device_requests"] = [docker.types.DeviceRequest(device_ids=[gpu], capabilities=[["gpu"]])]
            env = {**env, "CUDA_VISIBLE_DEVICES": "0"}
        return options | {
            "environment": env,
            "working_dir": cwd,
            "labels": _labels(env),
            "name": _name(env),
            "mounts": self._mounts(env, inbox),
            "network_mode": "host",  # the rendezvous (MASTER_ADDR:MASTER_PORT) works as for processes
            "init": True,
            "cap_add": list(spec.cap_add) or None,
            "pids_limit": spec.pids_limit,
            "user": spec.user,
        }

    def _mounts(self, env: Mapping[str, str], inbox: Path | None) -> list[docker.types.Mount]:
        mounts = {m.target: _bind(m.source, m.target, read_only=m.read_only) for m in self.spec.mounts}
        extra: list[tuple[str, bool]] = []
        if self.job.checkpoints is not None:
            extra.append((self.job.checkpoints.directory, False))
        if (jobs := self.engine.job_files_dir) is not None and env.get("REPRISE_JOB_ID"):
            # Every epoch's resume-file listing, read-only: a rank of this container restarted in place at a later
            # epoch reads that epoch's listing (REPRISE_RESUME_FILES of its order), written there after it started.
            job_files = jobs.absolute() / env["REPRISE_JOB_ID"]
            job_files.mkdir(parents=True, exist_ok=True)
            extra.append((str(job_files), True))
        if env.get("REPRISE_RESUME_FILES"):
            extra.append((os.path.dirname(env["REPRISE_RESUME_FILES"]), True))
        if env.get("REPRISE_SDK_SOCKET"):
            extra.append((env["REPRISE_SDK_SOCKET"], False))
        for source, read_only in extra:  # nested in a job's mount is fine (Docker mounts parents first), not twice
            mounts.setdefault(source, _bind(source, read_only=read_only))
        if inbox is not None:
            mounts[env["REPRISE_SDK_INBOX_DIR"]] = _bind(inbox, env["REPRISE_SDK_INBOX_DIR"], read_only=False)
        return list(mounts.values())

    def kill_lost(self, record: Mapping[str, Any]) -> None:
        """Remove a container an earlier process of this agent started."""
        self.engine.kill_lost(record)


class ContainerEngine:
    """This node's Docker daemon, as the agent uses it: a launcher per containerized job, lost containers removed."""

    def __init__(
        self,
        *,
        base_url: str,
        policy: ContainerPolicy,
        inbox_dir: Path | None = None,
        job_files_dir: Path | None = None,
        gpus: bool = False,
        timeout_s: float = 30.0,
    ) -> None:
        self.base_url = base_url
        self.policy = policy
        self.inbox_dir = inbox_dir
        self.job_files_dir = job_files_dir  # the agent's <state>/ranks: <job id>/epoch-N-resume-files.json
        self.gpus = gpus
        self.timeout_s = timeout_s
        self._client: docker.DockerClient | None = None

    def client(self) -> docker.DockerClient:
        """The SDK's client of the daemon (connected on first use)."""
        if self._client is None:
            try:
                self._client = docker.DockerClient(base_url=self.base_url, timeout=int(self.timeout_s))
            except docker.errors.DockerException as exc:
                raise DockerUnavailableError(f"the Docker daemon at {self.base_url} did not answer: {exc}") from exc
        return self._client

    def for_job(self, spec: LaunchArgs) -> ContainerLauncher:
        """A launcher for the job's ranks, after this node's rules and a look for its image (nothing is pulled)."""
        assert spec.container is not None
        self.policy.check(spec)
        try:
            self.client().images.get(spec.container.image)
        except docker.errors.ImageNotFound as exc:
            raise LaunchRefusedError(
                f"container.image {spec.container.image!r} is not on this node (images are never pulled)"
            ) from exc
        except (docker.errors.DockerException, OSError) as exc:
            raise DockerUnavailableError(f"the Docker daemon at {self.base_url} did not answer: {exc}") from exc
        return ContainerLauncher(self, spec)

    def kill_lost(self, record: Mapping[str, Any]) -> None:
        """Remove the container of a rank an earlier process of this agent started (its handle's record)."""
        try:
            self.client().containers.get(str(record["container_id"])).remove(force=True)
        except docker.errors.NotFound:
            pass
        except (docker.errors.DockerException, OSError) as exc:
            raise DockerUnavailableError(f"the Docker daemon at {self.base_url} did not answer: {exc}") from exc

    def remove_strays(self, node_id: str) -> list[str]:
        """Remove every container labelled with this node that is left after the ledger's (a ledger an agent died
        before writing); their ids."""
        try:
            strays = self.client().containers.list(all=True, filters={"label": f"{LABEL}.node={node_id}"})
            for stray in strays:
                with contextlib.suppress(docker.errors.NotFound):
                    stray.remove(force=True)
        except (docker.errors.DockerException, OSError) as exc:
            raise DockerUnavailableError(f"the Docker daemon at {self.base_url} did not answer: {exc}") from exc
        return [stray.id for stray in strays]

    def close(self) -> None:
        """Close the client's connections."""
        if self._client is not None:
            self._client.close()
            self._client = None
