"""Ranks in containers through the Docker Engine API: one container per rank on the host's network, its SDK socket,
inbox and checkpoint directories mounted, its limits from the job's ContainerSpec (docs/containers.md).

The container runs Docker's init (tini) as its pid 1 and the rank's command as its child: a signal from the host
reaches the rank like a process's signal would, and the rank's exit code comes back as tini's (128 + the signal for a
signal death, as a shell reports it). The rank's handle names the command's process as the host sees it, so that
reports, /proc samples and py-spy work on it as on a process.

A Python or shell rank (its command an interpreter named python..., or sh, bash, dash) writes its stdout and stderr
into a file of its inbox directory, which the agent reads from the host: a few lines of its own interpreter or shell
put them there and exec the command (same pid), so that its last output is there the moment it exits, not once the
daemon has copied it (docs/containers.md, "Exit and output"). Another command's output goes through the daemon's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import time
from collections.abc import Mapping, Sequence, Set
from pathlib import Path
from typing import Any

import docker
import docker.errors
import docker.types
from docker.models.containers import Container

from reprise_agent.launch.container_group import DEFAULT_GID, DIRECTORY, SHARED_DIRECTORY, grant
from reprise_agent.launch.container_handle import ContainerHandle
from reprise_agent.launch.container_output import OUTPUT_ENV, output_file, pointing
from reprise_agent.launch.container_policy import ContainerPolicy, DockerUnavailableError, LaunchRefusedError
from reprise_agent.launch.container_procs import kill_init, namespace_pid, rank_pid
from reprise_agent.launch.container_restart import LABEL, adopt, sdk_socket_link
from reprise_agent.launch.container_standby import ContainerStandbys
from reprise_common.events import ContainerSpec, ContainerSupport, LaunchArgs, StandbyStatus

__all__ = ["LABEL", "ContainerEngine", "ContainerHandle", "ContainerLauncher"]

IMAGE_SEEN_S = 60.0  # how long the daemon's word that it has an image is taken for granted


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
        """Start the rank on one of the job's ready standby containers when `warm` allows and one fits (a relaunch),
        else create and start a container for it; the job's standbys are then kept ready."""
        changes = self.env_changes(env)
        handle = await self.engine.standbys.take(self, argv, env, changes, cwd) if warm else None
        if handle is None:
            handle = await self._start_cold(argv, env, changes, cwd)
        self.engine.standbys.keep(self, argv, env, handle)
        return handle

    async def _start_cold(
        self, argv: Sequence[str], env: Mapping[str, str], changes: dict[str, str], cwd: str | None
    ) -> ContainerHandle:
        inbox = self.new_inbox(env)
        command, rank_env = list(argv), dict(env)
        output = output_file(self.engine.gid, inbox, env) if (pointed := pointing(argv)) is not None else None
        if pointed is not None and output is not None:
            command, rank_env[OUTPUT_ENV] = pointed, output[1]
        try:
            container, init_pid, pid = await asyncio.to_thread(self.run, command, rank_env, changes, cwd, inbox)
        except BaseException:
            if inbox is not None:
                shutil.rmtree(inbox, ignore_errors=True)
            raise
        handle = ContainerHandle(
            container, init_pid=init_pid, pid=pid, inbox=inbox, env_changes=changes,
            output_file=output[0] if output is not None else None,
        )  # fmt: skip
        handle.inbox_link = self.link_inbox(pid, inbox)
        handle.follow(asyncio.get_running_loop())
        return handle

    def link_inbox(self, pid: int, inbox: Path | None) -> Path | None:
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

    def new_inbox(self, env: Mapping[str, str]) -> Path | None:
        """A host directory of its own to mount as the rank's inbox directory: the SDK names its inbox by its pid in
        the container, which another container's rank may share."""
        if self.engine.inbox_dir is None or not env.get("REPRISE_SDK_INBOX_DIR"):
            return None
        path = self.engine.inbox_dir / "containers" / secrets.token_hex(6)
        path.mkdir(mode=0o700, parents=True)
        grant(path, self.engine.gid, DIRECTORY)  # the rank binds its inbox socket in there, whatever its user
        return path

    def env_changes(self, env: Mapping[str, str]) -> dict[str, str]:
        """What the rank's environment says otherwise in its container than on the host (also in an order to restart
        in place): device 0, its one GPU; the SDK socket through its directory, where a restarted agent's is found."""
        changes = {"CUDA_VISIBLE_DEVICES": "0"} if self.engine.gpus and env.get("CUDA_VISIBLE_DEVICES") else {}
        sdk = env.get("REPRISE_SDK_SOCKET")
        if sdk and (linked := sdk_socket_link(Path(sdk))) is not None:
            changes["REPRISE_SDK_SOCKET"] = str(linked)
        return changes

    def run(
        self, argv: list[str], env: dict[str, str], changes: dict[str, str], cwd: str | None, inbox: Path | None
    ) -> tuple[Container, int, int]:
        """Create and start the container (blocking calls: in a thread); its init's pid and the rank's."""
        if self.job.checkpoints is not None:  # a bind's source must exist; a job's first launch has saved nothing yet
            self._checkpoint_directory(Path(self.job.checkpoints.directory))
        created = self._create(argv, env, changes, cwd, inbox)
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

    def _checkpoint_directory(self, path: Path) -> None:
        """Create the job's checkpoint directory where it is missing, for its ranks to write whatever their user; one
        that exists is the job's own, left as it is."""
        if path.is_dir():
            return
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LaunchRefusedError(f"checkpoints.directory could not be created: {exc}") from exc
        grant(path, self.engine.gid, SHARED_DIRECTORY)

    def _create(
        self, argv: list[str], env: dict[str, str], changes: dict[str, str], cwd: str | None, inbox: Path | None
    ) -> Container:
        try:
            return self.engine.client().containers.create(
                self.spec.image, argv, **self._options(env, changes, cwd, inbox), detach=True
            )
        except docker.errors.ImageNotFound as exc:
            self.engine.images_seen.pop(self.spec.image, None)
            raise LaunchRefusedError(
                f"container.image {self.spec.image!r} is not on this node (images are never pulled): {exc.explanation}"
            ) from exc
        except docker.errors.APIError as exc:
            raise LaunchRefusedError(f"the Docker daemon refused the rank's container: {exc.explanation}") from exc
        except (docker.errors.DockerException, OSError) as exc:
            raise DockerUnavailableError(f"the Docker daemon did not answer: {exc}") from exc

    def _options(
        self, env: dict[str, str], changes: dict[str, str], cwd: str | None, inbox: Path | None
    ) -> dict[str, Any]:
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
        env = env | changes
        return options | {
            "environment": env,
            "working_dir": cwd,
            "labels": _labels(env),
            "name": _name(env),
            "mounts": self._mounts(env, inbox, sdk_directory="REPRISE_SDK_SOCKET" in changes),
            "network_mode": "host",  # the rendezvous (MASTER_ADDR:MASTER_PORT) works as for processes
            "init": True,
            "cap_add": list(spec.cap_add) or None,
            "pids_limit": spec.pids_limit,
            "user": spec.user,
            "group_add": [str(self.engine.gid)],  # what the agent made for the rank (launch/container_group.py)
        }

    def _mounts(self, env: Mapping[str, str], inbox: Path | None, *, sdk_directory: bool) -> list[docker.types.Mount]:
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
            sdk = env["REPRISE_SDK_SOCKET"]
            extra.append((os.path.dirname(sdk) if sdk_directory else sdk, False))
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
        sdk_socket: Path | None = None,
        gpus: bool = False,
        timeout_s: float = 30.0,
        standbys: ContainerStandbys | None = None,
        gid: int = DEFAULT_GID,
    ) -> None:
        self.base_url = base_url
        self.policy = policy
        self.inbox_dir = inbox_dir
        self.sdk_socket = sdk_socket  # the agent's: re-linked for the containers a restarted agent adopts
        self.job_files_dir = job_files_dir  # the agent's <state>/ranks: <job id>/epoch-N-resume-files.json
        self.gpus = gpus
        self.gid = gid  # every rank's container runs in this group too: what the agent makes for it belongs to it
        self.timeout_s = timeout_s
        self.standbys = standbys or ContainerStandbys(size=0, preload=())  # per containerized job: warm containers
        self.images_seen: dict[str, float] = {}  # image → when the daemon last said it has it (monotonic)
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
        """A launcher for the job's ranks, after this node's rules and a look for its image (nothing is pulled).

        The look asks the daemon once per IMAGE_SEEN_S for an image: it blocked the agent's loop for a round trip on
        every launch, also a recovery's that restarts every rank here in place or on a standby (no container made, no
        daemon needed). An image removed meanwhile fails the first container made of it, with the same error."""
        assert spec.container is not None
        self.policy.check(spec)
        image, now = spec.container.image, time.monotonic()
        if now - self.images_seen.get(image, -IMAGE_SEEN_S) < IMAGE_SEEN_S:
            return ContainerLauncher(self, spec)
        try:
            self.client().images.get(image)
        except docker.errors.ImageNotFound as exc:
            raise LaunchRefusedError(
                f"container.image {image!r} is not on this node (images are never pulled)"
            ) from exc
        except (docker.errors.DockerException, OSError) as exc:
            raise DockerUnavailableError(f"the Docker daemon at {self.base_url} did not answer: {exc}") from exc
        self.images_seen = {name: at for name, at in self.images_seen.items() if now - at < IMAGE_SEEN_S}
        self.images_seen[image] = now
        return ContainerLauncher(self, spec)

    def adopt(self, record: Mapping[str, Any]) -> ContainerHandle | None:
        """Supervise on a rank's container an earlier process of this agent started, when it still runs that rank
        (launch/container_restart.py); None when it does not (it is then to be removed). On the running loop."""
        try:
            handle = adopt(self.client(), record)
        except (docker.errors.DockerException, OSError) as exc:
            raise DockerUnavailableError(f"the Docker daemon at {self.base_url} did not answer: {exc}") from exc
        if handle is not None and self.sdk_socket is not None:
            sdk_socket_link(self.sdk_socket)  # this agent's socket, where the rank's SDK reconnects
        return handle

    def kill_lost(self, record: Mapping[str, Any]) -> None:
        """Remove the container of a rank an earlier process of this agent started (its handle's record); while the
        daemon does not answer, its init is killed from the host (the daemon removes the rest when it is back)."""
        try:
            self.client().containers.get(str(record["container_id"])).remove(force=True)
        except docker.errors.NotFound:
            pass
        except (docker.errors.DockerException, OSError) as exc:
            with contextlib.suppress(PermissionError):
                kill_init(int(record.get("init_pid") or 0), record.get("init_started"))
            raise DockerUnavailableError(f"the Docker daemon at {self.base_url} did not answer: {exc}") from exc

    def remove_strays(self, node_id: str, keep: Set[str] = frozenset()) -> list[str]:
        """Remove every container labelled with this node but those in `keep` (adopted): left after the ledger's (a
        ledger an agent died before writing); their ids."""
        try:
            found = self.client().containers.list(all=True, filters={"label": f"{LABEL}.node={node_id}"})
            strays = [c for c in found if c.id not in keep]
            for stray in strays:
                with contextlib.suppress(docker.errors.NotFound):
                    stray.remove(force=True)
        except (docker.errors.DockerException, OSError) as exc:
            raise DockerUnavailableError(f"the Docker daemon at {self.base_url} did not answer: {exc}") from exc
        return [stray.id for stray in strays]

    def prepare_standbys(self, spec: LaunchArgs, env: Mapping[str, str], *, hold_s: float) -> int:
        """Keep standbys of the job ready here before any of its ranks starts (a spare), after this node's rules and a
        look for its image (as a launch); how many (0: none here)."""
        return self.standbys.prepare(self.for_job(spec), spec.command, env, hold_s=hold_s)

    def drop_standbys(self, job_id: str) -> None:
        """Remove the job's prepared standbys."""
        self.standbys.drop(job_id)

    def support(self) -> ContainerSupport:
        """This node's rules for containerized jobs, as its reports carry them."""
        return self.policy.support()

    def standby_statuses(self) -> list[StandbyStatus]:
        """Every standby container waiting here."""
        return self.standbys.statuses()

    def close(self) -> None:
        """Remove the waiting standbys; close the client's connections."""
        self.standbys.close()
        if self._client is not None:
            self._client.close()
            self._client = None
