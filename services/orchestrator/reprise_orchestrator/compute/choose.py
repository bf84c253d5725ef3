"""Which compute backend a replica uses: the one its setting names.

`REPRISE_COMPUTE_BACKEND` names a built-in backend (`agents`, `slurm`, `kubernetes`) or a factory as
`package.module:callable`; the factory is called with a `BackendContext` and returns an object that implements
`ComputeBackend` (compute/backend.py).
Adding a backend needs nothing else: no flow, step or rule knows which backend runs.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

from reprise_common.bus import Bus
from reprise_common.clock import Clock
from reprise_common.errors import ConfigError
from reprise_orchestrator.compute.agents.backend import AgentsBackend
from reprise_orchestrator.compute.allocation import AgentLaunch
from reprise_orchestrator.compute.backend import ComputeBackend
from reprise_orchestrator.compute.kubernetes.api import KubeAccess, KubeApi
from reprise_orchestrator.compute.kubernetes.backend import KubernetesBackend
from reprise_orchestrator.compute.kubernetes.jobpods import PodSettings
from reprise_orchestrator.compute.slurm.backend import SlurmBackend
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
        standby_spares=settings.standby_spares,
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
        launch=_agent_launch(settings),
    )


def _agent_launch(settings: OrchestratorSettings) -> AgentLaunch:
    """How an allocation's agents start (REPRISE_SLURM_AGENT_*: the same for a Slurm batch script and a pod)."""
    return AgentLaunch(
        command=settings.slurm_agent_command,
        nats_url=settings.slurm_agent_nats_url or settings.nats_url,
        creds_dir=settings.slurm_agent_creds_dir,
        http_port=settings.slurm_agent_http_port,
        env=settings.slurm_agent_env,
    )


def _kube_access(settings: OrchestratorSettings) -> KubeAccess:
    """Where the API server is (the setting, or the in-cluster address) and the token and CA to reach it with."""
    url = settings.kubernetes_api_url
    if url is None:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ConfigError("REPRISE_KUBERNETES_API_URL is not set, and this replica does not run in a pod")
        url = f"https://{host}:{port}"
    try:
        token = settings.kubernetes_token_file.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"REPRISE_KUBERNETES_TOKEN_FILE={str(settings.kubernetes_token_file)!r}: {exc}") from exc
    if not token:
        raise ConfigError(f"REPRISE_KUBERNETES_TOKEN_FILE={str(settings.kubernetes_token_file)!r} is empty")
    ca_file = settings.kubernetes_ca_file
    if ca_file is not None and not ca_file.is_file():
        raise ConfigError(f"REPRISE_KUBERNETES_CA_FILE={str(ca_file)!r} is not a file (the API server's CA)")
    return KubeAccess(
        url=url, token=token, ca_file=str(ca_file) if ca_file else None, timeout_s=settings.kubernetes_request_timeout_s
    )


def _kubernetes(context: BackendContext) -> ComputeBackend:
    settings = context.settings
    namespaces = [settings.kubernetes_jobs_namespace]
    namespaces += [name for name in settings.kubernetes_namespaces if name != settings.kubernetes_jobs_namespace]
    if settings.kubernetes_jobs_namespace not in settings.kubernetes_namespaces:
        raise ConfigError(
            f"REPRISE_KUBERNETES_JOBS_NAMESPACE={settings.kubernetes_jobs_namespace!r} is not one of "
            f"REPRISE_KUBERNETES_NAMESPACES ({', '.join(settings.kubernetes_namespaces)})"
        )
    pods = PodSettings(
        launch=_agent_launch(settings),
        image=settings.kubernetes_agent_image,
        namespaces=tuple(namespaces),
        service_account=settings.kubernetes_service_accounts[0] if settings.kubernetes_service_accounts else None,
        seeds_secret=settings.kubernetes_agent_seeds_secret,
    )
    return KubernetesBackend(
        agents=_agents(context),  # the ranks are the agents' also on Kubernetes: they run in the jobs' pods
        api=KubeApi(_kube_access(settings)),
        label_selector=settings.kubernetes_node_selector,
        pods=pods,
    )


BUILT_IN: dict[str, BackendFactory] = {"agents": _agents, "slurm": _slurm, "kubernetes": _kubernetes}


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
