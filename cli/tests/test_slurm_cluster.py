"""The local Slurm cluster the tests and the demo run on: everything of it in its own directory and on its own ports,
and stopping it ends every daemon and job step it started, and nothing else."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from reprise_cli import slurm as slurm_module
from reprise_cli.ports import PortTaken, free_port
from reprise_cli.slurm import SlurmCluster, slurm_unavailable_reason
from reprise_common.errors import ConfigError
from reprise_common.procs import process_alive


def slurm(cluster: SlurmCluster, *argv: str, stdin: str | None = None) -> str:
    """Run a Slurm command against `cluster`; its output."""
    env = {**os.environ, **cluster.env}
    return subprocess.run(argv, input=stdin, env=env, capture_output=True, text=True, check=True, timeout=15).stdout


def step_tasks(cluster: SlurmCluster, step: str, node: str) -> list[int]:
    """The pids of a job step's tasks on one node (none while the step is not there yet)."""
    env = {**os.environ, **cluster.env}
    argv = ["scontrol", "listpids", step, node]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=15, check=False)
    rows = [line.split() for line in done.stdout.splitlines()[1:]]
    return [int(row[0]) for row in rows if row[3] != "-"]  # a task has a local id; slurmstepd's helpers do not


def test_the_cluster_lives_in_its_own_directory_on_its_own_ports(slurm_cluster: SlurmCluster) -> None:
    conf = dict(
        line.split("=", 1) for line in slurm_cluster.conf_path.read_text().splitlines() if not line.startswith("Node")
    )
    paths = [conf[key] for key in ("StateSaveLocation", "SlurmdSpoolDir", "SlurmctldPidFile", "SlurmctldLogFile")]
    assert all(Path(path).is_absolute() and Path(path).is_relative_to(slurm_cluster.directory) for path in paths)
    ports = [slurm_cluster.controller_port, *slurm_cluster.node_ports.values()]
    assert len(set(ports)) == len(ports) == 6
    assert "socket=/tmp/reprise-munge-" in conf["AuthInfo"]  # its own munged, not the host's
    daemons = [slurm_cluster.controller, *slurm_cluster.slurmds.values()]
    assert all(d is not None and d.alive() and d.argv[-2:] == ["-f", str(slurm_cluster.conf_path)] for d in daemons)
    assert slurm_cluster.node_states() == {f"node{index}": "idle" for index in range(1, 6)}


def test_stop_ends_every_daemon_and_job_step_it_started_and_only_those(
    slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # short: slurmd's step sockets live under it (under tmp_path, a pytest run numbered 100 or more went past the limit)
    other = SlurmCluster.on_free_ports(tmp_path_factory.mktemp("so"), nodes=2)
    other.start()
    try:
        script = "#!/bin/sh\nsrun sleep 300\n"
        job_id = slurm(other, "sbatch", "--parsable", "-N", "2", "-o", "/dev/null", stdin=script).strip()
        deadline = time.monotonic() + 20
        while slurm(other, "squeue", "-h", "-j", job_id, "-o", "%T").strip() != "RUNNING":
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.2)
        tasks: list[int] = []  # the processes of the job's ranks, found through Slurm on each node
        while len(tasks) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            tasks = [pid for node in other.node_names for pid in step_tasks(other, f"{job_id}.0", node)]
        assert len(tasks) == 2
        assert other.munge is not None and other.munge.runtime_dir is not None
        daemons = [other.munge.process, other.controller, *other.slurmds.values()]
        pids = [daemon.pid for daemon in daemons if daemon is not None]
        munge_dir = other.munge.runtime_dir
    finally:
        other.stop()

    assert not [pid for pid in [*pids, *tasks] if process_alive(pid)]
    assert not munge_dir.exists()
    assert not [path for path in (other.directory / "spool").glob("*/*_*") if path.is_socket()]  # no step left
    assert slurm_cluster.node_states() == dict.fromkeys(slurm_cluster.node_names, "idle")  # the other one runs on


def test_a_state_directory_too_deep_for_slurmds_sockets_is_refused(tmp_path: Path) -> None:
    cluster = SlurmCluster.on_free_ports(tmp_path / ("d" * 100), nodes=1)
    with pytest.raises(ConfigError, match="too deep"):
        cluster.start()
    assert cluster.controller is None and cluster.munge is None


@pytest.mark.parametrize("daemon", ["slurmctld", "slurmd"])
def test_a_port_taken_before_its_daemon_bound_it_starts_the_cluster_again_on_other_ports(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, daemon: str
) -> None:
    """free_port() chose a port that another process took before the daemon bound it: the start notices (PortTaken,
    not a timeout) and the cluster comes up on other ports."""
    reason = slurm_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        chosen = iter([taken] if daemon == "slurmctld" else [free_port(), taken])  # the controller's port comes first
        monkeypatch.setattr(slurm_module, "free_port", lambda: next(chosen, None) or free_port())

        directory = tmp_path_factory.mktemp("sp")  # short: slurmd's step sockets live under it
        first = SlurmCluster.on_free_ports(directory / "a", nodes=1)
        started = time.monotonic()
        with pytest.raises(PortTaken):
            first.start()
        assert time.monotonic() - started < 20  # noticed when the daemon ended, not after the 30 s wait for idle

        chosen = iter([taken] if daemon == "slurmctld" else [free_port(), taken])
        cluster = SlurmCluster.start_on_free_ports(directory / "b", nodes=1)
        try:
            assert taken not in [cluster.controller_port, *cluster.node_ports.values()]
            assert cluster.node_states() == {"node1": "idle"}
        finally:
            cluster.stop()
