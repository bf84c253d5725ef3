"""What the routes and background tasks share, and the FastAPI dependencies that hand it out."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from sqlmodel import Session

from reprise_registry.db import Engines
from reprise_registry.settings import RegistrySettings


@dataclass
class Deps:
    """The registry's engines, settings and the wake-up signals of its background loops."""

    settings: RegistrySettings
    engines: Engines
    validator_wake: asyncio.Event = field(default_factory=asyncio.Event)
    announcer_wake: asyncio.Event = field(default_factory=asyncio.Event)
    rechecks: set[int] = field(default_factory=set)  # checkpoints whose load failed: re-hashed in full next pass
    loop: asyncio.AbstractEventLoop | None = None

    def wake(self, event: asyncio.Event) -> None:
        """Set a loop's event from any thread (routes run in a thread pool)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(event.set)


def _deps(request: Request) -> Deps:
    deps: Deps = request.app.state.deps
    return deps


def _read_session(request: Request) -> Iterator[Session]:
    with Session(_deps(request).engines.read) as session:
        yield session


def _write_session(request: Request) -> Iterator[Session]:
    with Session(_deps(request).engines.write) as session:
        yield session


DepsDep = Annotated[Deps, Depends(_deps)]
ReadSession = Annotated[Session, Depends(_read_session)]
WriteSession = Annotated[Session, Depends(_write_session)]
