"""Requests on core NATS: to one subject, or to many at once (a command to every node of a job).

For many, one reply subscription serves the whole batch: every request carries a reply subject `<inbox>.<index>`, and
one deadline covers them all, so thousands of requests cost no task, future or timer each. A subject where nothing
listens is answered at once by the server ("no responders"), so only silent responders wait for the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import TypeVar

import nats.errors
from nats.aio.client import NO_RESPONDERS_STATUS, Client
from nats.aio.msg import Msg
from nats.js.api import Header
from pydantic import ValidationError

from reprise_common.errors import BadReplyError, BusError, NoRespondersError, NotConnectedError, RequestTimeoutError
from reprise_common.events import Wire

W = TypeVar("W", bound=Wire)


async def request_one(nc: Client, subject: str, message: Wire, reply_type: type[W], *, timeout: float) -> W:
    """Send a request and parse the reply; NoRespondersError, RequestTimeoutError, BadReplyError or BusError."""
    try:
        msg = await nc.request(subject, message.model_dump_json().encode(), timeout=timeout)
    except nats.errors.NoRespondersError as exc:
        raise NoRespondersError(subject) from exc
    except (nats.errors.TimeoutError, TimeoutError) as exc:
        raise RequestTimeoutError(f"no reply on {subject} within {timeout:g} s") from exc
    except nats.errors.Error as exc:
        raise BusError(f"request to {subject} failed: {exc!r}") from exc
    try:
        return reply_type.model_validate_json(msg.data)
    except ValidationError as exc:
        raise BadReplyError(f"bad reply on {subject}: {str(exc)[:200]}") from exc


async def request_many(
    nc: Client, messages: Mapping[str, Wire], reply_type: type[W], *, timeout: float
) -> dict[str, W | BusError]:
    """Send one request per subject at once; each subject's parsed reply, or the BusError saying why none came."""
    if not messages:
        return {}
    inbox = nc.new_inbox()
    subjects = list(messages)
    replies: dict[str, W | BusError] = {}
    complete = asyncio.Event()

    async def on_reply(msg: Msg) -> None:
        subject = subjects[int(msg.subject.rsplit(".", 1)[1])]
        if subject in replies:
            return  # a second responder on the subject: the first answer counts
        if msg.headers and msg.headers.get(Header.STATUS) == NO_RESPONDERS_STATUS:
            replies[subject] = NoRespondersError(subject)
        else:
            try:
                replies[subject] = reply_type.model_validate_json(msg.data)
            except ValidationError as exc:
                replies[subject] = BadReplyError(f"bad reply on {subject}: {str(exc)[:200]}")
        if len(replies) == len(subjects):
            complete.set()

    sub = await nc.subscribe(f"{inbox}.*", cb=on_reply, pending_msgs_limit=len(subjects) + 1)
    try:
        for index, subject in enumerate(subjects):
            try:
                payload = messages[subject].model_dump_json().encode()
                await nc.publish(subject, payload, reply=f"{inbox}.{index}")
            except nats.errors.ConnectionClosedError as exc:
                replies[subject] = NotConnectedError(f"request to {subject} failed: {exc!r}")
            except nats.errors.Error as exc:  # a payload over the server's limit, a connection going away
                replies[subject] = BusError(f"request to {subject} failed: {exc!r}")
        if len(replies) < len(subjects):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(complete.wait(), timeout)
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
    missing = RequestTimeoutError(f"no reply within {timeout:g} s")
    return {subject: replies.get(subject, missing) for subject in subjects}
