"""The batch script of a job's Slurm allocation: one Reprise agent per allocated node, started with `srun`.

Each agent gets what `reprise up` gives the local stack's agents (cli/reprise_cli/topology.py), through its
environment: the NATS URL and its node's NATS seed, its node id (the Slurm node name), whether it is a spare, its HTTP
port (the setting plus the node's index in the allocation, or any free one when the setting is 0: several agents on
one host, as on the local test cluster), its state directory, and the further agent settings the orchestrator is
configured with. The first `workers` nodes of the allocation (Slurm's order, `$SLURM_NODEID`) are the job's workers,
the others its spares. Every value is shell-quoted: nothing from a setting or a spec can run as a command.
"""

from __future__ import annotations

import shlex

from reprise_orchestrator.compute.allocation import AgentLaunch, AllocationRequest

__all__ = ["AgentLaunch", "batch_script"]  # AgentLaunch lives in compute/allocation.py, shared with Kubernetes

# Set per node inside the step, from Slurm's own variables; the rest is the same on every node.
_PER_NODE = """\
export REPRISE_NODE_ID="$SLURMD_NODENAME"
if [ "$SLURM_NODEID" -lt "$REPRISE_SLURM_WORKERS" ]; then REPRISE_SPARE=false; else REPRISE_SPARE=true; fi
export REPRISE_SPARE
if [ "$REPRISE_SLURM_AGENT_PORT" -eq 0 ]; then REPRISE_HTTP_PORT=0; else
  REPRISE_HTTP_PORT=$((REPRISE_SLURM_AGENT_PORT + SLURM_NODEID))
fi
export REPRISE_HTTP_PORT
export REPRISE_STATE_DIR="${REPRISE_STATE_DIR:-${TMPDIR:-/tmp}/reprise-agent-$SLURM_JOB_ID}/$SLURMD_NODENAME"
export REPRISE_ADVERTISE_ADDR="${REPRISE_ADVERTISE_ADDR:-$(hostname)}"
if [ -n "$REPRISE_SLURM_CREDS_DIR" ]; then
  export REPRISE_NATS_NKEY_SEED_FILE="$REPRISE_SLURM_CREDS_DIR/$SLURMD_NODENAME.nk"
fi
mkdir -p "$REPRISE_STATE_DIR"
"""


def batch_script(request: AllocationRequest, launch: AgentLaunch) -> str:
    """The allocation's batch script: the agents' shared settings, then `srun` starting one agent on every node."""
    shared = {
        **launch.shared_env(),
        "REPRISE_SLURM_WORKERS": str(request.workers),
        "REPRISE_SLURM_AGENT_PORT": str(launch.http_port),
        "REPRISE_SLURM_CREDS_DIR": str(launch.creds_dir) if launch.creds_dir is not None else "",
    }
    exports = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in shared.items())
    agent = _PER_NODE + "exec " + " ".join(shlex.quote(part) for part in launch.argv()) + "\n"
    return (
        "#!/bin/sh\n"
        f"# Reprise: the allocation of job {request.job_id}, one agent per node: the first {request.workers} node(s)\n"
        f"# are its workers, the other {request.spares} its spares.\n"
        f"{exports}"
        f"exec srun --no-kill --ntasks-per-node=1 --kill-on-bad-exit=0 sh -c {shlex.quote(agent)}\n"
    )
