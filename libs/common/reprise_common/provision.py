"""What the JetStream server keeps for Reprise: its streams (created, or updated by their owner, retried while a
cluster forms) and the durable consumers that read them (created, or given the limits they should have now)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DiscardPolicy, RetentionPolicy, StreamConfig

from reprise_common.errors import BusError
from reprise_common.logging import get_logger
from reprise_common.subjects import StreamSpec

# Records are named after what provisions: the bus its streams, a consumer its durable consumer.
bus_log = get_logger("reprise.bus")
consumer_log = get_logger("reprise.consumer")
_STREAM_EXISTS_DIFFERENTLY = 10058
_CLUSTER_NO_PEERS = 10005  # "no suitable peers for placement": too few cluster members have joined yet
# JetStream still forming (no meta leader yet): the API times out, has no responder, or answers 503
_JETSTREAM_FORMING = (TimeoutError, nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError)


def stream_config(spec: StreamSpec, *, replicas: int = 1) -> StreamConfig:
    """The JetStream configuration for one of Reprise's streams, stored on `replicas` servers of a cluster."""
    return StreamConfig(
        name=spec.name,
        num_replicas=replicas,
        description=spec.description,
        subjects=list(spec.subjects),
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        max_age=spec.max_age_s,
        max_msgs_per_subject=spec.max_msgs_per_subject,
        duplicate_window=spec.duplicate_window_s,
    )


async def ensure_streams(
    js: JetStreamContext, streams: Sequence[StreamSpec], *, replicas: int, updates_streams: bool
) -> None:
    """Create each stream, or (the streams' owner only: `updates_streams`) update it to the wanted configuration;
    safe to call any number of times.

    An update also purges what an older release stored under subjects the stream no longer takes (node reports
    in AGENT): they would otherwise hold the server's disk until they age out. Any other service leaves a stream
    that exists as it is (its permissions allow no update, so no service but the owner can change a stream's
    retention, limits or subjects).
    """
    for spec in streams:
        config = stream_config(spec, replicas=replicas)
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != _STREAM_EXISTS_DIFFERENTLY:
                raise BusError(f"cannot provision stream {spec.name}: {exc}") from exc
            if not updates_streams:
                bus_log.info("stream differs from this release's; its owner updates it", extra={"stream": spec.name})
                continue
            await js.update_stream(config)
            for subject in spec.retired_subjects:
                await js.purge_stream(spec.name, subject=subject)
                bus_log.info("purged a retired subject", extra={"stream": spec.name, "subject": subject})
        except nats.js.errors.ServerError as exc:  # e.g. replicas > 1 on a server that is not in a cluster
            raise BusError(f"cannot provision stream {spec.name}: {exc}") from exc


async def provision_when_formed(
    ensure: Callable[[], Awaitable[None]], *, url: str, attempts: int | None, retry_s: float
) -> None:
    """`ensure` (ensure_streams), retried while JetStream is not available yet: a cluster that has just started has
    no meta leader, or too few members for a replicated stream, for a few seconds (a service started with it, or
    after a whole-cluster restart, would otherwise never become ready). Any other refusal raises at once."""
    tries = 0
    while True:
        tries += 1
        try:
            await ensure()
            return
        except _JETSTREAM_FORMING as exc:
            reason: Exception = exc
        except BusError as exc:
            cause = exc.__cause__
            if not (isinstance(cause, nats.js.errors.BadRequestError) and cause.err_code == _CLUSTER_NO_PEERS):
                raise
            reason = exc
        if attempts is not None and tries >= attempts:
            raise BusError(f"JetStream at {url} is not available: {reason!r}") from reason
        if tries == 1:
            bus_log.warning("JetStream not available yet: provisioning again", extra={"error": repr(reason)})
        await asyncio.sleep(retry_s)


async def ensure_consumer(js: JetStreamContext, stream: str, wanted: ConsumerConfig) -> None:
    """Create the durable consumer if it is missing, or apply the limits it should have to one that exists."""
    if wanted.durable_name is None:
        raise ValueError("a durable consumer needs its name")
    try:
        info = await js.consumer_info(stream, wanted.durable_name)
    except nats.js.errors.NotFoundError:
        await js.add_consumer(stream, config=wanted)
    else:
        await _update_limits(js, stream, info.config, wanted)


async def _update_limits(js: JetStreamContext, stream: str, found: ConsumerConfig, wanted: ConsumerConfig) -> None:
    """Apply the ack wait and delivery limits a consumer wants to one that an earlier run created otherwise.

    The server keeps a durable consumer's config, so a changed ack wait would otherwise never take effect. Only
    these limits are changed (the server refuses a change of e.g. the deliver policy); a refusal is logged.
    """
    limits = {
        "ack_wait": wanted.ack_wait,
        "max_deliver": wanted.max_deliver,
        "max_ack_pending": wanted.max_ack_pending,
    }
    if all(getattr(found, name) == value for name, value in limits.items()):
        return
    durable = wanted.durable_name
    try:
        await js.add_consumer(stream, config=found.evolve(**limits))
    except nats.js.errors.Error as exc:
        consumer_log.warning("could not update the consumer's limits", extra={"consumer": durable, "error": repr(exc)})
        return
    consumer_log.info("updated the consumer's limits", extra={"consumer": durable, **limits})
