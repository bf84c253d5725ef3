"""Which compute backend a replica uses: the one its setting names.

`REPRISE_COMPUTE_BACKEND` names a built-in backend (`agents`, `slurm`) or a factory as `package.module:callable`; the
factory is called with a `BackendContext` and returns an object that implements `ComputeBackend` (compute/backend.py).
Adding a backend needs nothing else: no flow, step or rule knows which backend runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from reprise_common.bus import Bus
from reprise_common.clock import Clock
from reprise_common.errors import ConfigError
from reprise_orchestrator.compute.agents.backend import AgentsBackend
from reprise_orchestrator.compute.backend import ComputeBackend
from reprise_orchestrator.compute.slurm.backend import SlurmBackend
from reprise_orchestrator.compute.slurm.batch import AgentLaunch
from reprise_orchestrator.compute.slurm.cli import SlurmCli
from reprise_orchestrator.inventory import Inventory
from reprise_orchestrator.settings import OrchestratorSettings


@dataclass(frozen=True)
class BackendContext:
    """What a backend factory may use: the replica's settings, its bus, the node inventory and the clock."""

    settings: OrchestratorSettings
    bus: Bus
    inventory: Inventory
    clock: Clock


BackendFactory = Callable[[BackendContext], ComputeBackend]


def _agents(context: BackendContext) -> AgentsBackend:
    settings = context.settings
    return AgentsBackend(
        bus=context.bus,
        inventory=context.inventory,
        command_timeout_s=settings.command_timeout_s,
        stop_grace_s=settings.stop_grace_s,
        in_place_limit_s=settings.in_place_limit_s,
        stack_capture_s=settings.stack_capture_s,
    )


def _slurm(context: BackendContext) -> ComputeBackend:
    settings = context.settings
    if settings.slurm_conf is not None and not settings.slurm_conf.is_file():
        raise ConfigError(f"REPRISE_SLURM_CONF={str(settings.slurm_conf)!r} is not a file (the cluster's slurm.conf)")
    return SlurmBackend(
        agents=_agents(context),  # the ranks are the agents' also on Slurm: they run inside the allocation
        cli=SlurmCli(conf=settings.slurm_conf, timeout_s=settings.slurm_command_timeout_s),
        clock=context.clock,
        poll_interval_s=settings.slurm_poll_interval_s,
        partition=settings.slurm_partition,
        launch=AgentLaunch(
            command=settings.slurm_agent_command,
            nats_url=settings.slurm_agent_nats_url or settings.nats_url,
            creds_dir=settings.slurm_agent_creds_dir,
            http_port=settings.slurm_agent_http_port,
            env=settings.slurm_agent_env,
        ),
    )


BUILT_IN: dict[str, BackendFactory] = {"agents": _agents, "slurm": _slurm}


def open_backend(context: BackendContext) -> ComputeBackend:
    """The backend the settings name: a built-in one, or `module:factory`; ConfigError says what is wrong."""
    name = context.settings.compute_backend
    factory = BUILT_IN.get(name)
    if factory is None:
        factory = _import_factory(name)
    return factory(context)


def _import_factory(path: str) -> BackendFactory:
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ConfigError(
            f"REPRISE_COMPUTE_BACKEND={path!r}: use one of {', '.join(BUILT_IN)} or package.module:factory"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"REPRISE_COMPUTE_BACKEND={path!r} cannot be loaded: {exc}") from exc
    if not callable(factory):
        raise ConfigError(f"REPRISE_COMPUTE_BACKEND={path!r} is not callable")
    return factory  # type: ignore[no-any-return]
