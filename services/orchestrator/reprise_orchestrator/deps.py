"""What the orchestrator's flows need, built once per process and passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.engine import Engine

from reprise_common.bus import Bus
from reprise_common.clock import Clock
from reprise_orchestrator.locks import RedisJobLocks
from reprise_orchestrator.nodes.inventory import Inventory
from reprise_orchestrator.registry_client import RegistryClient
from reprise_orchestrator.settings import OrchestratorSettings


@dataclass
class Deps:
    """The orchestrator's collaborators."""

    settings: OrchestratorSettings
    engine: Engine
    bus: Bus
    locks: RedisJobLocks
    inventory: Inventory
    registry: RegistryClient
    clock: Clock
