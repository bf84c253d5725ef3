"""Bus.request_many against a real nats-server: every subject gets its own reply, or the reason there was none."""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg

from reprise_cli.servers import NatsServer
from reprise_common.bus import Bus
from reprise_common.errors import BusError
from reprise_common.events import Wire


class Ping(Wire):
    """A test request."""

    text: str


class Pong(Wire):
    """A test reply: what was asked, and on which subject."""

    text: str
    subject: str


async def _responders(nats_server: NatsServer) -> Bus:
    """A second client that answers `echo.*`, answers `garbled` with junk and takes `silent` without answering."""
    bus = Bus(url=nats_server.url, service="test-responder", provision=False)
    await bus.connect(attempts=5)

    async def echo(msg: Msg) -> None:
        ping = Ping.model_validate_json(msg.data)
        await msg.respond(Pong(text=ping.text, subject=msg.subject).model_dump_json().encode())

    async def garbled(msg: Msg) -> None:
        await msg.respond(b"not json")

    async def silent(_msg: Msg) -> None:
        return None

    await bus.nc.subscribe("echo.*", cb=echo)
    await bus.nc.subscribe("garbled", cb=garbled)
    await bus.nc.subscribe("silent", cb=silent)
    await bus.nc.flush()
    return bus


async def test_each_subject_gets_its_reply_or_why_none_came(nats_server: NatsServer) -> None:
    responder = await _responders(nats_server)
    bus = Bus(url=nats_server.url, service="test", provision=False)
    await bus.connect(attempts=5)
    messages = {
        "echo.a": Ping(text="a"),
        "echo.b": Ping(text="b"),
        "nobody": Ping(text="c"),
        "garbled": Ping(text="d"),
        "silent": Ping(text="e"),
    }
    loop = asyncio.get_running_loop()
    started = loop.time()
    replies = await bus.request_many(messages, Pong, timeout=1.0)
    assert loop.time() - started >= 1.0  # it waited for the silent one, once, not once per subject

    assert replies["echo.a"] == Pong(text="a", subject="echo.a")
    assert replies["echo.b"] == Pong(text="b", subject="echo.b")
    assert isinstance(replies["nobody"], BusError) and str(replies["nobody"]) == "no responder on nobody"
    assert isinstance(replies["garbled"], BusError) and str(replies["garbled"]).startswith("bad reply on garbled")
    assert isinstance(replies["silent"], BusError) and str(replies["silent"]) == "no reply within 1 s"
    assert list(replies) == list(messages)
    await bus.close()
    await responder.close()


async def test_thousands_of_requests_are_matched_to_their_subjects(nats_server: NatsServer) -> None:
    responder = await _responders(nats_server)
    bus = Bus(url=nats_server.url, service="test", provision=False)
    await bus.connect(attempts=5)
    messages = {f"echo.n{index:04d}": Ping(text=str(index)) for index in range(3000)}
    replies = await bus.request_many(messages, Pong, timeout=30.0)
    assert replies == {subject: Pong(text=ping.text, subject=subject) for subject, ping in messages.items()}
    assert await bus.request_many({}, Pong) == {}
    await bus.close()
    await responder.close()
