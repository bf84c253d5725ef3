"""Each service and agent, with the NATS identity the stack gives it, against a real nats-server: it may publish and
receive only its own subjects. Above all no node and no service but the orchestrator can command an agent, which
accepts any fence at or above the highest it saw: only the server's permissions stop a forged command."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from reprise_cli.creds import init_credentials, node_keys_file
from reprise_cli.servers import deploy_dir
from reprise_cli.topology import StackConfig, build_services
from reprise_common import subjects
from reprise_common.advisories import ClientAdvisory, read_advisory
from reprise_common.aio import poll_until
from reprise_common.auth import KeyCheck, KeyCheckAnswer, Scope
from reprise_common.errors import BusError
from reprise_common.events import (
    CommandReply,
    CommandResult,
    FaultKind,
    InjectFault,
    InjectReply,
    PingCommand,
)

from .conftest import NODES, SERVICES, Deployment

IDENTITIES = (*SERVICES, *NODES)
ORCHESTRATOR = frozenset({"orchestrator"})
DETECTOR = frozenset({"detector"})

# Who may publish to each subject (core NATS; a JetStream publish needs the same permission).
PUBLISHERS: dict[str, frozenset[str]] = {
    subjects.node_command("node-1"): ORCHESTRATOR,
    subjects.node_inject("node-1"): ORCHESTRATOR,
    subjects.placement("job-1"): ORCHESTRATOR,
    subjects.recovery("job-1", "started"): ORCHESTRATOR,
    subjects.compute_signal("agents"): ORCHESTRATOR,
    subjects.dead_letter("orchestrator"): ORCHESTRATOR,
    subjects.incident("job-1", "opened"): DETECTOR,
    subjects.node_quarantine("node-1"): DETECTOR,
    subjects.dead_letter("detector"): DETECTOR,
    subjects.checkpoint("job-1", "validated"): frozenset({"checkpoint-registry"}),
    subjects.dead_letter("checkpoint-registry"): frozenset({"checkpoint-registry"}),
    subjects.dead_letter("notifier"): frozenset({"notifier"}),
    subjects.AUTH_VERIFY: frozenset({"checkpoint-registry", "detector", "notifier", "dashboard"}),  # API key checks
    subjects.node_report("node-1"): frozenset({"node-1"}),
    subjects.node_event("node-1", "gpu.xid"): frozenset({"node-1"}),
    subjects.node_event("node-2", "checkpoint.saved"): frozenset({"node-2"}),
    subjects.CLIENT_DISCONNECTED: frozenset(),  # the server's own advisory: a forged one could fake a node loss
    subjects.CLIENT_CONNECTED: frozenset(),
}

# Who may receive each subject on core NATS (stored subjects are read through durable consumers instead).
RECEIVERS: dict[str, frozenset[str]] = {
    subjects.node_command("node-1"): frozenset({"node-1"}),
    subjects.node_inject("node-1"): frozenset({"node-1"}),
    subjects.node_report("node-1"): frozenset({"detector", "orchestrator"}),
    subjects.AUTH_VERIFY: ORCHESTRATOR,  # the key authority: whoever answers a key check grants its scopes
    subjects.incident("job-1", "opened"): frozenset({"dashboard"}),
    subjects.recovery("job-1", "started"): frozenset({"dashboard"}),
    subjects.node_event("node-1", "gpu.xid"): frozenset(),
    subjects.placement("job-1"): frozenset(),
    subjects.CLIENT_DISCONNECTED: DETECTOR,  # agents' connections, for node loss at once
    subjects.CLIENT_CONNECTED: DETECTOR,
    # Replies: each identity only its own inbox (the orchestrator's holds agents' answers and key-check verdicts)
    f"{subjects.inbox_prefix('orchestrator')}.reply": ORCHESTRATOR,
    f"{subjects.inbox_prefix('checkpoint-registry')}.reply": frozenset({"checkpoint-registry"}),
    f"{subjects.inbox_prefix('node-2')}.reply": frozenset({"node-2"}),
    "_INBOX.reply": frozenset(),  # the shared default prefix: nobody's
}
SETTLE_S = 0.3  # how long a message that should not arrive is waited for, once all that should have


async def _routable(sender: Client, receiver: Client) -> None:
    """Wait until what sender publishes reaches receiver's subscriptions: the server answers a subscriber's flush a
    moment before other connections' messages reach a new subscription of a user with permissions."""
    probe = receiver.new_inbox()  # its own reply inbox, which every identity may receive
    arrived = asyncio.Event()

    async def on_probe(_msg: Msg) -> None:
        arrived.set()

    await receiver.subscribe(probe, cb=on_probe)
    await receiver.flush()
    for _ in range(250):
        await sender.publish(probe, b"")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(arrived.wait(), timeout=0.02)
            return
    raise AssertionError("no message reached the new subscription within 5 s")


async def _record(client: Client, subscribe: list[str]) -> list[str]:
    """Subscribe to each subject; the subjects of what arrives."""
    arrived: list[str] = []

    async def record(msg: Msg) -> None:
        arrived.append(msg.subject)

    for subject in subscribe:
        await client.subscribe(subject, cb=record)
    await client.flush()
    return arrived


async def _settled(arrived: list[str], allowed: set[str]) -> set[str]:
    """What arrived once everything allowed has, and a moment more for anything that should not (the server does not
    order messages of different senders, so no marker can say that all has been delivered)."""
    await poll_until(lambda: allowed <= set(arrived), timeout_s=5)
    await asyncio.sleep(SETTLE_S)
    return set(arrived)


def _refused(errors: list[Exception]) -> str:
    return " ".join(str(exc) for exc in errors).lower()


@pytest.mark.parametrize("identity", IDENTITIES)
async def test_publishes_only_its_own_subjects(deployment: Deployment, admin: Client, identity: str) -> None:
    arrived = await _record(admin, [f"{subjects.PREFIX}.>"])
    prober = await nats.connect(deployment.url, nkeys_seed=str(deployment.admin_seed))
    await _routable(prober, admin)
    await prober.close()
    arrived.clear()
    errors: list[Exception] = []
    client = await deployment.client(identity, errors)
    for subject in PUBLISHERS:
        await client.publish(subject, b"{}")
    await client.flush()  # the server has answered each refused one (-ERR) before it answers the flush
    allowed = {subject for subject, who in PUBLISHERS.items() if identity in who}
    got = await _settled(arrived, allowed)
    assert got == allowed, (
        f"{identity}: got through where it must not: {sorted(got - allowed)}; "
        f"refused where it must not be: {sorted(allowed - got)}"
    )
    for subject in set(PUBLISHERS) - allowed:
        refused = f'publish to "{subject.lower()}"'  # the server's error names the subject in lower case
        assert refused in _refused(errors), f"{identity}: no violation for {subject}: {errors}"
    await client.close()


@pytest.mark.parametrize("identity", IDENTITIES)
async def test_receives_only_its_own_subjects(deployment: Deployment, admin: Client, identity: str) -> None:
    errors: list[Exception] = []
    client = await deployment.client(identity, errors)
    arrived = await _record(client, list(RECEIVERS))
    await _routable(admin, client)
    for subject in RECEIVERS:
        await admin.publish(subject, b"{}")
    await admin.flush()
    allowed = {subject for subject, who in RECEIVERS.items() if identity in who}
    got = await _settled(arrived, allowed)
    assert got == allowed, (
        f"{identity}: received what it must not: {sorted(got - allowed)}; "
        f"missed what it must receive: {sorted(allowed - got)}"
    )
    for subject in set(RECEIVERS) - allowed:
        refused = f'subscription to "{subject.lower()}"'
        assert refused in _refused(errors), f"{identity}: no violation for {subject}: {errors}"
    await client.close()


async def test_the_detector_hears_of_an_agents_connection_by_its_key_as_the_server_says(
    deployment: Deployment,
) -> None:
    errors: list[Exception] = []
    detector = await deployment.client("detector", errors)
    advisories: list[ClientAdvisory] = []

    async def record(msg: Msg) -> None:
        advisories.append(read_advisory(msg.data))

    for subject in subjects.CLIENT_EVENTS:
        await detector.subscribe(subject, cb=record)
    await detector.flush()
    keys = json.loads(node_keys_file(deployment.seeds["node-2"].parent).read_text())

    def of_node_2(closing: bool) -> list[ClientAdvisory]:  # other clients of the deployment may come and go meanwhile
        return [a for a in advisories if a.disconnected is closing and keys.get(a.client.user) == "node-2"]

    agent = await deployment.client("node-2", errors)
    assert await poll_until(lambda: bool(of_node_2(False)), timeout_s=5)
    await agent.close()
    assert await poll_until(lambda: bool(of_node_2(True)), timeout_s=5)
    [connected], [closed] = of_node_2(False), of_node_2(True)
    assert connected.client.id == closed.client.id and closed.reason == "Client Closed"
    assert not errors
    await detector.close()


@pytest.mark.parametrize("forger", [name for name in IDENTITIES if name != "orchestrator"])
async def test_only_the_orchestrator_commands_an_agent(deployment: Deployment, forger: str) -> None:
    agent = deployment.bus("node-1")
    await agent.connect(attempts=5)
    commands: list[str] = []
    injections: list[FaultKind] = []

    async def on_command(data: bytes) -> CommandReply:
        command = PingCommand.model_validate_json(data)
        commands.append(command.command_id)
        return CommandReply(command_id=command.command_id, node_id="node-1", result=CommandResult.DONE)

    async def on_inject(data: bytes) -> InjectReply:
        injections.append(InjectFault.model_validate_json(data).kind)
        return InjectReply(accepted=True)

    await agent.serve(subjects.node_command("node-1"), on_command)
    await agent.serve(subjects.node_inject("node-1"), on_inject)
    await agent.nc.flush()
    forged = deployment.bus(forger)
    await forged.connect(attempts=5)
    # A fence far above any real one: the agent would take it and fence out the orchestrator from then on.
    stop = PingCommand(command_id="forged", job_id="job-1", fence=10**9)
    with pytest.raises(BusError):
        await forged.request(subjects.node_command("node-1"), stop, CommandReply, timeout=1.0)
    with pytest.raises(BusError):
        await forged.request(
            subjects.node_inject("node-1"), InjectFault(kind=FaultKind.RANK_HANG), InjectReply, timeout=1.0
        )
    orchestrator = deployment.bus("orchestrator")
    await orchestrator.connect(attempts=5)
    ping = PingCommand(command_id="real", job_id="job-1", fence=1)
    replies = await orchestrator.request_many({subjects.node_command("node-1"): ping}, CommandReply, timeout=5.0)
    reply = replies[subjects.node_command("node-1")]
    assert isinstance(reply, CommandReply) and reply.result is CommandResult.DONE, reply
    drill = await orchestrator.request(
        subjects.node_inject("node-1"), InjectFault(kind=FaultKind.XID, xid=79), InjectReply, timeout=5.0
    )
    assert drill.accepted
    assert commands == ["real"], f"the agent took a command from {forger}"
    assert injections == [FaultKind.XID], f"the agent took a fault injection from {forger}"
    for bus in (forged, orchestrator, agent):
        await bus.close()


async def test_only_the_orchestrator_answers_api_key_checks(deployment: Deployment) -> None:
    authority = deployment.bus("orchestrator")
    await authority.connect(attempts=5)
    checked: list[str] = []

    async def answer(data: bytes) -> KeyCheckAnswer:
        checked.append(KeyCheck.model_validate_json(data).digest)
        return KeyCheckAnswer(valid=True, key_id="k1", name="ci", scopes=[Scope.READ])

    await authority.serve(subjects.AUTH_VERIFY, answer, queue=subjects.AUTH_VERIFY_QUEUE)
    await authority.nc.flush()
    errors: list[Exception] = []
    impostor = await deployment.client("notifier", errors)  # would answer every check "valid, admin"
    await impostor.subscribe(subjects.AUTH_VERIFY, queue=subjects.AUTH_VERIFY_QUEUE)
    await impostor.flush()
    assert await poll_until(lambda: f'subscription to "{subjects.AUTH_VERIFY}"' in _refused(errors), timeout_s=5)
    check = KeyCheck(digest="0" * 64)
    for asker in ("checkpoint-registry", "detector", "notifier", "dashboard"):
        bus = deployment.bus(asker)
        await bus.connect(attempts=5)
        reply = await bus.request(subjects.AUTH_VERIFY, check, KeyCheckAnswer, timeout=5.0)
        assert reply.valid and reply.scopes == [Scope.READ], asker
        await bus.close()
    node = deployment.bus("node-1")  # a node has no business asking, nor a way to probe digests
    await node.connect(attempts=5)
    with pytest.raises(BusError):
        await node.request(subjects.AUTH_VERIFY, check, KeyCheckAnswer, timeout=1.0)
    assert len(checked) == 4
    for each in (node, authority):
        await each.close()
    await impostor.close()


def test_every_process_of_the_stack_has_its_own_identity_and_none_the_admin(tmp_path: Path) -> None:
    specs = build_services(StackConfig(nodes=2, spares=1, state_dir=tmp_path / "state"))
    seeds = {spec.name: Path(spec.env["REPRISE_NATS_NKEY_SEED_FILE"]).name for spec in specs}
    shared = {seed for seed in seeds.values() if list(seeds.values()).count(seed) > 1}
    assert not shared, f"processes share NATS identities {sorted(shared)}: {seeds}"
    assert "admin.nk" not in seeds.values(), seeds
    for spec in specs:
        own = spec.env["REPRISE_NODE_ID"] if spec.role == "agent" else spec.name
        assert seeds[spec.name] == f"{own}.nk", f"{spec.name} gets {seeds[spec.name]}"


@pytest.mark.parametrize("node", ["orchestrator", "detector", "admin", "platform"])
def test_a_node_cannot_take_the_name_of_a_platform_identity(tmp_path: Path, node: str) -> None:
    with pytest.raises(ValueError, match="platform identity"):
        init_credentials(tmp_path / "creds", nodes=["node-1", node], base_config=deploy_dir() / "nats" / "nats.conf")
    assert not (tmp_path / "creds").exists()
