"""Pull requests to a durable JetStream consumer, answered on an inbox of our own.

nats-py's `fetch` waits for each message of a batch on its own (a timer task and several turns of the event loop per
message: about 45 µs each, most of the time a storm of 16,384 symptoms took). Here the subscription's callback only
appends each message to a list, and a fetch waits once for the batch. One request is open at a time; a message that
arrives after its fetch returned (the request was still being answered) is kept for the next fetch, never lost, and
handed back (nak) when the inbox closes.

Protocol facts (JetStream pull consumers): a request `{"batch": n, "expires": ns}` published to
`$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>` with our inbox as reply is answered with up to n messages; it ends
when n were delivered, or with a header-only status message: 408 (expired), 404 (nothing pending, no_wait) or 409
(e.g. the consumer was deleted, or too many requests wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import DEFAULT_PREFIX, Header, StatusCode

from reprise_common.errors import BusError

EXPIRY_GRACE_S = 1.0  # a request unanswered this long after it expired was lost (e.g. with a server restart)
LOST_LIMIT = 2  # requests lost in a row before the inbox gives up (its caller subscribes again, with a new inbox)


class PullInbox:
    """Fetches batches from one durable consumer through one inbox subscription."""

    def __init__(
        self,
        nc: Client,
        *,
        stream: str,
        consumer: str,
        pending_msgs: int,
        pending_bytes: int,
        api_prefix: str = DEFAULT_PREFIX,
    ) -> None:
        self.nc = nc
        self.next_subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self.pending_msgs = pending_msgs
        self.pending_bytes = pending_bytes
        self._inbox = nc.new_inbox()
        self._sub: Subscription | None = None
        self._waiting: deque[Msg] = deque()  # delivered, not yet handed out
        self._arrived = asyncio.Event()
        self._open_until: float | None = None  # monotonic time the open request is given up at; None: none open
        self._owed = 0  # messages the open request may still deliver
        self._conflict = ""  # a 409's description: the consumer is gone or refuses requests
        self._lost = 0  # requests in a row that expired without their end (no last message, no status) arriving

    async def open(self) -> None:
        """Subscribe to the inbox (the server has the subscription before a request is sent)."""
        self._sub = await self.nc.subscribe(
            self._inbox, cb=self._on_msg, pending_msgs_limit=self.pending_msgs, pending_bytes_limit=self.pending_bytes
        )

    async def close(self) -> None:
        """Unsubscribe; messages delivered but never handed out are given back (nak) for redelivery now."""
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
            self._sub = None
        while self._waiting:
            with contextlib.suppress(nats.errors.Error):
                await self._waiting.popleft().nak()

    async def fetch(self, batch: int, *, timeout: float, linger: float) -> list[Msg]:
        """Up to `batch` messages: wait up to `timeout` for the first (TimeoutError if none), then up to `linger` at a
        time for more while the consumer reports more pending; BusError when the consumer refuses requests."""
        loop = asyncio.get_running_loop()
        if not self._waiting:
            self._arrived.clear()  # before the request: what answers while it is being sent still wakes the wait
            await self._request(batch, timeout, loop.time())
            if not self._waiting and self._open_until is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), timeout)
            if self._conflict:
                raise BusError(f"pull request refused: {self._conflict}")
            if not self._waiting:
                raise TimeoutError
        while len(self._waiting) < batch and self._waiting[-1].metadata.num_pending and self._open_until is not None:
            before = len(self._waiting)
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), linger)
            if len(self._waiting) == before:
                break
        count = min(batch, len(self._waiting))
        return [self._waiting.popleft() for _ in range(count)]

    async def _request(self, batch: int, expires_s: float, now: float) -> None:
        if self._open_until is not None:
            if now < self._open_until:
                return  # the open request still delivers what arrives
            # Its end never came: lost on its way to the consumer's leader, or its answer on the way back (seen in a
            # cluster after a member's restart, where every later request was lost too). A new inbox and a fresh
            # look at the consumer (the caller's resubscription) get past it; waiting does not.
            self._lost += 1
            if self._lost >= LOST_LIMIT:
                raise BusError(f"{self._lost} pull requests in a row went unanswered")
        self._open_until, self._owed, self._conflict = now + expires_s + EXPIRY_GRACE_S, batch, ""
        request = {"batch": batch, "expires": int(expires_s * 1e9)}
        await self.nc.publish(self.next_subject, json.dumps(request).encode(), reply=self._inbox)

    async def _on_msg(self, msg: Msg) -> None:
        status = msg.headers.get(Header.STATUS) if msg.headers else None
        if status is None:
            self._waiting.append(msg)
            self._owed -= 1
            if self._owed <= 0:
                self._open_until, self._lost = None, 0
        elif status != StatusCode.CONTROL_MESSAGE:  # 404, 408, 409: the request is over
            self._open_until, self._lost = None, 0
            if status == StatusCode.CONFLICT:
                self._conflict = msg.headers.get(Header.DESCRIPTION, "conflict") if msg.headers else "conflict"
        self._arrived.set()
