"""A real Slurm cluster on this one host, for the tests and the demo: a controller and one `slurmd` per node.

Debian's `slurm-wlm` (22.05) runs several `slurmd` on one host when each node is declared with
`NodeHostname=localhost NodeAddr=127.0.0.1` and a port of its own, and each daemon is started with an absolute `-f`
path. Everything of one cluster (configuration, state, spool, logs, pids) lives in its own directory on its own free
ports, so runs never meet. It authenticates through a munged of its own (own key, own socket, named in slurm.conf by
`AuthInfo`): the host's munged is neither needed nor touched, and stopping the cluster stops only what it started.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from reprise_cli.creds import private_draft
from reprise_cli.ports import PortTaken, with_port_retries
from reprise_cli.servers import ManagedProcess, free_port, wait_until
from reprise_common.errors import ConfigError

SLURM_COMMANDS = ("slurmctld", "slurmd", "munged", "sinfo", "squeue", "sbatch", "srun", "scontrol", "scancel")
INSTALL_HINT = "run `make slurm-deps` as root (apt-get install slurm-wlm munge)"
_SOCKET_PATH_MAX = 107  # sun_path of a Unix socket: slurmd puts one per job step in its spool directory
_STEP_SOCKET_SUFFIX = "_4294967294.4294967294"  # a step's socket: <node>_<job id>.<step id>, at its longest


def _sbin(name: str) -> str | None:
    """A Slurm or munge binary: PATH, else /usr/sbin (not on a non-root PATH)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def slurm_unavailable_reason() -> str | None:
    """Why a local Slurm cluster cannot run here (a missing command, not root), or None when it can."""
    missing = [name for name in SLURM_COMMANDS if _sbin(name) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} not found): {INSTALL_HINT}"
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd starts each job as its user; SlurmUser=root)"
    return None


def _require(name: str) -> str:
    found = _sbin(name)
    if found is None:
        raise ConfigError(f"{name} not found: {INSTALL_HINT}")
    return found


@dataclass
class MungeDaemon:
    """A munged of our own: a fresh key and a socket in a runtime directory it removes when stopped.

    The directory is made under /tmp, not in the cluster's: munged refuses a socket whose every parent directory is
    not searchable by all (pytest's temporary directories are 0700), and a Unix socket's path must stay short.
    """

    log_path: Path
    runtime_dir: Path | None = None
    process: ManagedProcess | None = None

    @property
    def socket(self) -> Path:
        """The socket Slurm's daemons and commands reach munged on."""
        if self.runtime_dir is None:
            raise RuntimeError("munged was not started")
        return self.runtime_dir / "munge.sock"

    def start(self, timeout_s: float = 10.0) -> None:
        """Write a key, start munged in the foreground and wait until its socket is there."""
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="reprise-munge-"))
        self.runtime_dir.chmod(0o711)
        key = self.runtime_dir / "munge.key"
        private_draft(key, os.urandom(128).hex()).replace(key)  # munged takes any 32+ bytes; mungekey does the same
        argv = [
            _require("munged"),
            "--foreground",
            f"--socket={self.socket}",
            f"--key-file={key}",
            f"--pid-file={self.runtime_dir / 'munged.pid'}",
            f"--seed-file={self.runtime_dir / 'munged.seed'}",
            f"--log-file={self.log_path.absolute()}",
        ]
        self.process = ManagedProcess("munged", argv, self.log_path.with_suffix(".out"))
        self.process.start()
        if not wait_until(lambda: self.socket.exists() or not self._alive(), timeout_s=timeout_s) or not self._alive():
            tail = self.process.log_tail()
            self.stop()
            raise ConfigError(f"munged did not start: {tail.splitlines()[-1:]}")

    def _alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def stop(self) -> None:
        """Stop munged and remove its runtime directory (key and socket)."""
        if self.process is not None:
            self.process.stop(grace_s=5.0)
        if self.runtime_dir is not None:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)


@dataclass
class SlurmCluster:
    """A controller and `nodes` slurmd (node1..nodeN, one CPU each) in one partition, all under `directory`."""

    directory: Path
    controller_port: int
    node_ports: dict[str, int]
    partition: str = "reprise"
    urgent_partition: str = "urgent"  # its jobs preempt those of `partition` (requeued)
    cluster_name: str = "reprise"
    slurmd_timeout_s: int = 5  # a dead slurmd's node is NOT_RESPONDING, then DOWN, within about 2-3 times this
    requeue_delay_s: int = 10  # a requeued job may run again after this (cred_expire; Slurm's default is 120 s)
    munge: MungeDaemon | None = None
    controller: ManagedProcess | None = None
    slurmds: dict[str, ManagedProcess] = field(default_factory=dict)

    @classmethod
    def on_free_ports(cls, directory: Path, *, nodes: int = 5) -> SlurmCluster:
        """A cluster of `nodes` nodes on free ports, its files under `directory`."""
        return cls(
            directory=directory.absolute(),
            controller_port=free_port(),
            node_ports={f"node{index}": free_port() for index in range(1, nodes + 1)},
        )

    @classmethod
    def start_on_free_ports(cls, directory: Path, *, nodes: int = 5, timeout_s: float = 30.0) -> SlurmCluster:
        """A cluster as on_free_ports gives it, started; when one of its ports was taken before its daemon bound it,
        everything is stopped and the cluster started again on other ports, with its state and spools wiped (they
        name the old ports)."""

        def launch() -> SlurmCluster:
            cluster = cls.on_free_ports(directory, nodes=nodes)
            try:
                cluster.start(timeout_s=timeout_s)
            except PortTaken:  # start() stopped what it had started
                for sub in ("state", "spool"):
                    shutil.rmtree(cluster.directory / sub, ignore_errors=True)
                raise
            return cluster

        return with_port_retries(launch)

    @property
    def conf_path(self) -> Path:
        """The absolute path of the cluster's slurm.conf (what SLURM_CONF names)."""
        return self.directory / "slurm.conf"

    @property
    def node_names(self) -> list[str]:
        """The nodes, in order."""
        return list(self.node_ports)

    @property
    def env(self) -> dict[str, str]:
        """The environment Slurm's commands need to reach this cluster."""
        return {"SLURM_CONF": str(self.conf_path)}

    def config(self) -> str:
        """The cluster's slurm.conf."""
        if self.munge is None:
            raise RuntimeError("the cluster's munged is not started")
        d = self.directory
        lines = [
            f"ClusterName={self.cluster_name}",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={self.controller_port}",
            f"SlurmdPort={next(iter(self.node_ports.values()))}",  # every node overrides it with its own Port
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge.socket},cred_expire={self.requeue_delay_s}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",  # the declared CPUs, not the host's, and no drain for the mismatch
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SchedulerParameters=sched_interval=2,bf_interval=2",  # a job that may run starts within seconds
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool' / '%n'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}",
            "ReturnToService=2",  # a node that was DOWN for not responding is back as soon as its slurmd registers
            f"SlurmdTimeout={self.slurmd_timeout_s}",
            "SlurmctldTimeout=5",
            "MessageTimeout=5",
            "KillWait=2",  # SIGTERM to SIGKILL on cancel (Slurm's default is 30 s)
            "InactiveLimit=0",
            "MinJobAge=60",
            # A job in the urgent partition preempts one in the default partition, which Slurm requeues (preempt())
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
        ]
        lines += [
            f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=1 State=UNKNOWN"
            for name, port in self.node_ports.items()
        ]
        nodes = ",".join(self.node_ports)
        lines.append(f"PartitionName={self.partition} Nodes={nodes} Default=YES MaxTime=INFINITE PriorityTier=1")
        lines.append(f"PartitionName={self.urgent_partition} Nodes={nodes} MaxTime=INFINITE PriorityTier=2")
        return "\n".join(lines) + "\n"

    def _prepare(self) -> None:
        node = max(self.node_ports, key=len)
        longest = self.directory / "spool" / node / f"{node}{_STEP_SOCKET_SUFFIX}"
        if len(str(longest)) > _SOCKET_PATH_MAX:
            raise ConfigError(f"Slurm's state directory {self.directory} is too deep for slurmd's step sockets")
        for sub in ("state", "log", *(f"spool/{name}" for name in self.node_ports)):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)

    def start(self, timeout_s: float = 30.0) -> None:
        """Start munged, the controller and every slurmd, and wait until `sinfo` shows every node idle."""
        self._prepare()
        reason = slurm_unavailable_reason()
        if reason is not None:
            raise ConfigError(reason)
        self.munge = MungeDaemon(self.directory / "log" / "munged.log")
        try:
            self.munge.start()
            self.conf_path.write_text(self.config())
            self.start_controller()
            for name in self.node_ports:
                self.start_node(name)
            for name, port in self.node_ports.items():  # PortTaken when a slurmd lost its port to another process
                slurmd = self.slurmds[name]
                if not wait_until(functools.partial(slurmd.listening, port), timeout_s=timeout_s, interval_s=0.1):
                    raise ConfigError(f"slurmd of {name} does not listen on port {port}: {slurmd.log_tail(3)}")
            if not self.wait_idle(timeout_s=timeout_s):
                raise ConfigError(f"Slurm nodes not idle after {timeout_s:.0f} s: {self.node_states()}")
        except BaseException:
            self.stop()
            raise

    def _daemon(self, name: str, argv: list[str]) -> ManagedProcess:
        process = ManagedProcess(name, argv, self.directory / "log" / f"{name}.out", env=self.env, cwd=self.directory)
        process.start()
        return process

    def start_controller(self, timeout_s: float = 15.0) -> None:
        """Start slurmctld and wait until it answers (again after stop_controller: it recovers its jobs and nodes
        from its state directory)."""
        if self.controller is not None:
            self.controller.stop(grace_s=10.0)
        argv = [_require("slurmctld"), "-D", "-f", str(self.conf_path)]
        controller = self.controller = self._daemon("slurmctld", argv)

        def answers() -> bool:  # listening() raises PortTaken when slurmctld ended for a port another process took
            return controller.listening(self.controller_port) and self.controller_answers()

        if not wait_until(answers, timeout_s=timeout_s, interval_s=0.2):
            raise ConfigError(f"slurmctld did not answer within {timeout_s:.0f} s: {self.controller.log_tail(3)}")

    def controller_answers(self) -> bool:
        """True when slurmctld answers `scontrol ping`."""
        done = self._command("scontrol", "ping", timeout_s=5.0)
        return done is not None and done.returncode == 0

    def stop_controller(self) -> None:
        """Stop slurmctld (it saves its state); the nodes' slurmd keep running."""
        if self.controller is not None:
            self.controller.stop(grace_s=10.0)

    def pause_controller(self, paused: bool = True) -> None:
        """Freeze slurmctld (SIGSTOP) so that it accepts connections but answers nothing; False thaws it."""
        if self.controller is not None:
            self.controller.signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def start_node(self, name: str) -> None:
        """Start the slurmd of node `name` (again, after kill_node)."""
        previous = self.slurmds.get(name)
        if previous is not None:
            previous.stop(grace_s=5.0)
        argv = [_require("slurmd"), "-D", "-N", name, "-f", str(self.conf_path)]
        self.slurmds[name] = self._daemon(f"slurmd-{name}", argv)

    def kill_node(self, name: str) -> None:
        """Kill node `name`'s slurmd with SIGKILL, as a node that is lost."""
        self.slurmds[name].signal(signal.SIGKILL)

    def _command(self, *argv: str, timeout_s: float = 10.0) -> subprocess.CompletedProcess[str] | None:
        """Run a Slurm command against this cluster; None when it did not answer in time."""
        try:
            return subprocess.run(
                [_require(argv[0]), *argv[1:]],
                env={**os.environ, **self.env},
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return None

    def node_states(self) -> dict[str, str]:
        """Each node's state as `sinfo` prints it (e.g. idle, drained, down*); empty when the controller is away."""
        done = self._command("sinfo", "--noheader", "--Node", "--format=%N %T", timeout_s=5.0)
        if done is None or done.returncode != 0:
            return {}
        return dict(line.split(maxsplit=1) for line in done.stdout.splitlines() if line.strip())

    def preempt(self, *, nodes: int = 1, seconds: float = 5.0) -> str:
        """Submit a job of the urgent partition on `nodes` nodes for `seconds`: Slurm preempts (requeues) the jobs of
        the default partition in its way, as a higher-priority job does on a shared cluster; its Slurm job id."""
        done = self._command(
            "sbatch", "--parsable", f"--partition={self.urgent_partition}", f"--nodes={nodes}", "--job-name=urgent",
            f"--output={self.directory / 'log' / 'urgent-%j.out'}", f"--wrap=sleep {seconds:g}",
        )  # fmt: skip
        if done is None or done.returncode != 0:
            raise ConfigError(f"the urgent job was not submitted: {done.stderr if done else 'sbatch timed out'}")
        return done.stdout.strip()

    def node_view(self) -> dict[str, tuple[str, str]]:
        """Each node's state and reason as `sinfo -N` prints them (e.g. ("drained", "reprise: incident ..."),
        ("down*", "Not responding")); empty when the controller is away."""
        done = self._command("sinfo", "--noheader", "--Node", "--format=%N|%T|%E", timeout_s=5.0)
        if done is None or done.returncode != 0:
            return {}
        view = {}
        for line in done.stdout.splitlines():
            name, state, reason = [*line.split("|", 2), "", ""][:3]
            if name.strip():
                view[name.strip()] = (state.strip(), "" if reason.strip() == "none" else reason.strip())
        return view

    def wait_idle(self, *, timeout_s: float = 30.0) -> bool:
        """Wait until every node is idle (no job, no flag)."""
        return wait_until(
            lambda: self.node_states() == dict.fromkeys(self.node_ports, "idle"), timeout_s=timeout_s, interval_s=0.3
        )

    def _busy(self) -> bool:
        """True while a job is known to the controller or a job step still runs on a node (its socket in a spool)."""
        jobs = self._command("squeue", "--noheader", "--format=%i", timeout_s=5.0)
        if jobs is not None and jobs.returncode == 0 and jobs.stdout.strip():
            return True
        return any(path.is_socket() for path in (self.directory / "spool").glob("*/*_*"))

    def reset(self, *, timeout_s: float = 30.0) -> None:
        """Bring the cluster back to every node idle: the controller and every slurmd running, no job, no drain."""
        if self.controller is not None and not self.controller.alive():
            self.start_controller()
        self.pause_controller(paused=False)
        for name, process in self.slurmds.items():
            if not process.alive():
                self.start_node(name)
        self._cancel_all()
        wait_until(lambda: not self._busy(), timeout_s=timeout_s, interval_s=0.3)
        stuck = [name for name, state in self.node_states().items() if state.startswith(("drain", "down", "fail"))]
        if stuck:
            self._command("scontrol", "update", f"NodeName={','.join(stuck)}", "State=RESUME")
        if not self.wait_idle(timeout_s=timeout_s):
            raise ConfigError(f"Slurm nodes not idle after a reset: {self.node_states()}")

    def _cancel_all(self) -> None:
        for partition in (self.partition, self.urgent_partition):
            self._command("scancel", f"--partition={partition}")

    def stop(self) -> None:
        """Cancel the cluster's jobs, wait for their steps to end, then stop every daemon this cluster started."""
        if self.controller is not None and self.controller.alive():
            self.pause_controller(paused=False)
            self._cancel_all()
            wait_until(lambda: not self._busy(), timeout_s=15.0, interval_s=0.3)
        for process in self.slurmds.values():
            process.stop(grace_s=5.0)
        if self.controller is not None:
            self.controller.stop(grace_s=10.0)
        if self.munge is not None:
            self.munge.stop()
