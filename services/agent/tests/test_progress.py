"""Rank progress from the SDK: the book's statistics on a manual clock; the real socket fed by real SDK processes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from reprise_agent.progress.book import STATUS_FIELDS, STEP_WINDOW, ProgressBook
from reprise_agent.progress.messages import MalformedSdkMessage, MessageKind, SdkMessage, parse_message
from reprise_agent.progress.server import SdkServer, default_socket_path
from reprise_common.aio import poll_until
from reprise_common.clock import ManualClock
from reprise_common.events import RankStatus

SECOND_NS = 1_000_000_000


def beat(step: int, at_s: float, *, rank: int = 0, phase: str = "", **metrics: float) -> SdkMessage:
    return SdkMessage(
        MessageKind.HEARTBEAT, "job-1", rank, 0, int(at_s * SECOND_NS), step, phase=phase, metrics=metrics
    )


def phase_change(name: str, at_s: float, *, rank: int = 0) -> SdkMessage:
    return SdkMessage(MessageKind.PHASE, "job-1", rank, 0, int(at_s * SECOND_NS), phase=name)


# --- the book on a manual clock ---------------------------------------------------------------------------------
def test_a_rank_is_in_startup_until_its_first_heartbeat() -> None:
    clock = ManualClock()
    book = ProgressBook(clock)
    book.begin("job-1", 0)
    clock.advance(42)
    assert book.status_fields("job-1", 0) == {
        "step": None,
        "heartbeat_age_s": None,
        "phase": "startup",
        "phase_age_s": 42.0,
        "step_time_p50_s": None,
        "step_time_p99_s": None,
        "step_time_last_s": None,
        "resumed_via": "",
        "resumed_step": None,
        "resumed_why": "",
    }
    book.record(beat(1, 42))
    clock.advance(3)
    fields = book.status_fields("job-1", 0)
    assert (fields["step"], fields["heartbeat_age_s"], fields["phase"], fields["phase_age_s"]) == (
        1,
        3.0,
        "training",
        3.0,
    )


def test_status_fields_fill_a_rank_status() -> None:
    book = ProgressBook(ManualClock())
    assert set(STATUS_FIELDS) < set(RankStatus.model_fields)
    book.record(beat(7, 0))
    status = RankStatus(job_id="job-1", rank=0, pid=123, **book.status_fields("job-1", 0))
    assert status.step == 7 and status.phase == "training"
    assert RankStatus(job_id="job-9", rank=5, **book.status_fields("job-9", 5)).phase == "startup"


def test_step_time_is_time_between_step_increases_over_the_step_delta() -> None:
    clock = ManualClock()
    book = ProgressBook(clock)
    book.record(beat(10, 100.0))
    book.record(beat(10, 100.2))  # the same step again: no step time, and the step's start is kept
    book.record(beat(14, 100.4))  # four steps in 0.4 s (heartbeats between were coalesced by the SDK)
    fields = book.status_fields("job-1", 0)
    assert fields["step_time_last_s"] == pytest.approx(0.1)
    book.record(beat(15, 100.9))
    fields = book.status_fields("job-1", 0)
    assert fields["step_time_last_s"] == pytest.approx(0.5)
    assert fields["step_time_p50_s"] == pytest.approx(0.1)
    assert fields["step_time_p99_s"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("durations", "p50", "p99"),
    [
        ([0.2], 0.2, 0.2),
        ([0.1] * 99 + [5.0], 0.1, 0.1),  # one outlier in 100 is the 100th percentile, not the 99th
        ([0.1] * 98 + [5.0, 5.0], 0.1, 5.0),
        ([0.3, 0.1, 0.2, 0.4], 0.2, 0.4),
        ([float(i) for i in range(1, 1001)], 872.0, 998.0),  # only the newest STEP_WINDOW (256) steps count
    ],
)
def test_step_time_percentiles(durations: list[float], p50: float, p99: float) -> None:
    book = ProgressBook(ManualClock())
    at = 0.0
    book.record(beat(0, at))
    for step, duration in enumerate(durations, start=1):
        at += duration
        book.record(beat(step, at))
    fields = book.status_fields("job-1", 0)
    assert fields["step_time_p50_s"] == pytest.approx(p50)
    assert fields["step_time_p99_s"] == pytest.approx(p99)
    assert fields["step_time_last_s"] == pytest.approx(durations[-1])
    assert STEP_WINDOW == 256


def test_a_step_spanning_a_phase_is_not_a_step_time() -> None:
    clock = ManualClock()
    book = ProgressBook(clock)
    book.record(beat(1, 0.0))
    book.record(beat(2, 0.1))
    book.record(phase_change("checkpointing", 0.15))
    clock.advance(30)
    fields = book.status_fields("job-1", 0)
    assert (fields["phase"], fields["phase_age_s"], fields["heartbeat_age_s"]) == ("checkpointing", 30.0, 30.0)
    book.record(phase_change("", 30.1))  # the context manager ended: back to training
    book.record(beat(3, 30.2))
    book.record(beat(4, 30.3))
    fields = book.status_fields("job-1", 0)
    assert fields["phase"] == "training"
    assert fields["step_time_p99_s"] == pytest.approx(0.1)  # the 30 s save is not a 30 s step


def test_an_explicit_phase_before_the_first_step_is_kept() -> None:
    clock = ManualClock()
    book = ProgressBook(clock)
    book.record(phase_change("loading-data", 0))
    clock.advance(5)
    assert book.status_fields("job-1", 0)["phase"] == "loading-data"
    book.record(phase_change("", 5))  # ended before any step: still starting up
    assert book.status_fields("job-1", 0)["phase"] == "startup"
    book.record(beat(0, 6, phase="warmup"))  # a heartbeat inside an explicit phase keeps it
    assert book.status_fields("job-1", 0)["phase"] == "warmup"


def test_a_step_going_back_restarts_the_step_clock() -> None:
    book = ProgressBook(ManualClock())
    book.record(beat(100, 0.0))
    book.record(beat(50, 1.0))  # the script reloaded an older checkpoint
    book.record(beat(51, 1.2))
    fields = book.status_fields("job-1", 0)
    assert fields["step"] == 51 and fields["step_time_p99_s"] == pytest.approx(0.2)


def test_the_senders_clock_stepping_back_falls_back_to_ours() -> None:
    clock = ManualClock()
    book = ProgressBook(clock)
    book.record(beat(1, 1000.0))
    clock.advance(0.25)
    book.record(beat(2, 990.0))  # NTP stepped the rank's wall clock back by 10 s
    assert book.status_fields("job-1", 0)["step_time_last_s"] == pytest.approx(0.25)


def test_metrics_epoch_and_forget() -> None:
    book = ProgressBook(ManualClock())
    book.record(SdkMessage(MessageKind.HEARTBEAT, "job-1", 3, 2, 0, 5, metrics={"loss": 1.5}))
    book.record(SdkMessage(MessageKind.HEARTBEAT, "job-1", 3, 2, 1, 6))
    assert book.metrics("job-1", 3) == {"loss": 1.5}  # a heartbeat without metrics keeps the last ones
    assert book.restart_epoch("job-1", 3) == 2
    book.forget("job-1")
    assert book.status_fields("job-1", 3)["step"] is None
    assert book.metrics("job-1", 3) == {} and book.restart_epoch("job-1", 3) is None


def epoch_beat(step: int, epoch: int) -> SdkMessage:
    return SdkMessage(MessageKind.HEARTBEAT, "job-1", 0, epoch, step * SECOND_NS, step)


def test_a_relaunch_starts_progress_afresh_and_the_old_incarnation_is_ignored() -> None:
    clock = ManualClock()
    book = ProgressBook(clock)
    book.begin("job-1", 0, restart_epoch=1)
    book.record(epoch_beat(500, 1))
    book.record(epoch_beat(501, 1))
    book.begin("job-1", 0, restart_epoch=2)  # relaunched from the checkpoint of step 400
    clock.advance(7)
    assert book.status_fields("job-1", 0)["step"] is None
    assert book.status_fields("job-1", 0)["phase_age_s"] == 7.0
    book.record(epoch_beat(502, 1))  # the old rank, not quite dead yet
    assert book.stale == 1 and book.status_fields("job-1", 0)["step"] is None
    book.record(epoch_beat(400, 2))
    book.begin("job-1", 0, restart_epoch=2)  # a late begin() must not wipe what the new rank already said
    fields = book.status_fields("job-1", 0)
    assert (fields["step"], fields["step_time_p50_s"]) == (400, None)


def test_a_newer_epoch_without_begin_also_starts_afresh() -> None:
    book = ProgressBook(ManualClock())
    book.record(epoch_beat(10, 0))
    book.record(epoch_beat(11, 0))
    book.record(epoch_beat(3, 1))
    assert book.status_fields("job-1", 0)["step"] == 3
    assert book.status_fields("job-1", 0)["step_time_p50_s"] is None
    assert book.restart_epoch("job-1", 0) == 1


def test_each_rank_of_each_launch_is_announced_once_at_its_first_heartbeat() -> None:
    book = ProgressBook(ManualClock())
    started: list[tuple[str, int]] = []
    book.on_rank_training(lambda job, rank: started.append((job, rank)))
    book.begin("job-1", 0, restart_epoch=0)
    book.record(phase_change("loading", 0.5))
    assert started == []  # a phase is no step
    book.record(epoch_beat(1, 0))
    book.record(epoch_beat(2, 0))
    book.record(SdkMessage(MessageKind.HEARTBEAT, "job-1", 1, 0, SECOND_NS, 1))
    assert started == [("job-1", 0), ("job-1", 1)]
    book.begin("job-1", 0, restart_epoch=1)  # relaunched
    book.record(epoch_beat(3, 0))  # the old incarnation: stale, not announced
    book.record(epoch_beat(1, 1))
    book.record(epoch_beat(2, 1))
    assert started == [("job-1", 0), ("job-1", 1), ("job-1", 0)]


def test_checkpoint_callbacks_fire_and_one_failing_does_not_stop_the_others() -> None:
    book = ProgressBook(ManualClock())
    seen: list[tuple[str, int, int, str, list[str]]] = []

    def broken(*args: Any) -> None:
        raise RuntimeError("consumer bug")

    book.on_checkpoint_saved(broken)
    book.on_checkpoint_saved(lambda m: seen.append((m.job_id, m.rank, m.step, m.path, list(m.files))))
    book.record(SdkMessage(MessageKind.CHECKPOINT, "job-1", 1, 0, 0, 300, path="/ck/300", files=("/ck/300/r1",)))
    assert seen == [("job-1", 1, 300, "/ck/300", ["/ck/300/r1"])]


def test_ranks_beyond_the_limit_are_refused_not_stored() -> None:
    book = ProgressBook(ManualClock(), max_ranks=2)
    for rank in range(5):
        book.record(beat(1, 0, rank=rank))
    assert book.refused == 3
    assert book.status_fields("job-1", 4)["step"] is None
    book.forget("job-1")
    book.record(beat(1, 0, rank=4))
    assert book.status_fields("job-1", 4)["step"] == 1


# --- parsing ----------------------------------------------------------------------------------------------------
def test_parse_reads_what_the_sdk_writes_and_ignores_unknown_fields() -> None:
    message = parse_message(
        b'{"v":1,"job":"j","rank":2,"epoch":1,"k":"hb","step":9,"t_ns":5,"phase":"","m":{"loss":0.5,"n":3,"x":"s"},'
        b'"new_field":true}'
    )
    assert message == SdkMessage(MessageKind.HEARTBEAT, "j", 2, 1, 5, 9, metrics={"loss": 0.5, "n": 3.0})
    checkpoint = parse_message(
        b'{"v":1,"job":"j","rank":0,"epoch":0,"k":"ckpt","step":9,"t_ns":5,"path":"/c","files":["/c/a"]}'
    )
    assert (checkpoint.kind, checkpoint.path, checkpoint.files) == (MessageKind.CHECKPOINT, "/c", ("/c/a",))


def test_where_a_rank_resumed_from_reaches_its_status() -> None:
    book = ProgressBook(ManualClock())
    book.record(parse_message(b'{"v":1,"job":"j","rank":1,"epoch":2,"k":"resumed","t_ns":5,"via":"peer","step":41,'
                              b'"why":"state of step 41 from rank 0"}'))  # fmt: skip
    fields = book.status_fields("j", 1)
    assert (fields["resumed_via"], fields["resumed_step"], fields["resumed_why"]) == (
        "peer", 41, "state of step 41 from rank 0"
    )  # fmt: skip
    RankStatus(job_id="j", rank=1, **fields)  # the report takes them as they are
    fallback = parse_message(b'{"v":1,"job":"j","rank":0,"epoch":2,"k":"resumed","t_ns":5,"via":"checkpoint"}')
    assert (fallback.via, fallback.step) == ("checkpoint", None)


GARBAGE = [
    (b"", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b"[" * 100_000, "not JSON"),
    (b'{"v":2,"job":"j","rank":0,"epoch":0,"k":"hb","step":1,"t_ns":1}', "protocol version 2"),
    (b'{"v":1,"job":"j","rank":0,"epoch":0,"k":"bye","t_ns":1}', "unknown kind"),
    (b'{"v":1,"job":"","rank":0,"epoch":0,"k":"hb","step":1,"t_ns":1}', "job is empty"),
    (b'{"v":1,"job":"j","rank":-1,"epoch":0,"k":"hb","step":1,"t_ns":1}', "rank"),
    (b'{"v":1,"job":"j","rank":0,"epoch":0,"k":"hb","step":1.5,"t_ns":1}', "step"),
    (b'{"v":1,"job":"j","rank":0,"epoch":0,"k":"hb","step":true,"t_ns":1}', "step"),
    (b'{"v":1,"job":"j","rank":0,"epoch":0,"k":"hb","step":1,"t_ns":1,"m":[1]}', "m is not an object"),
    (b'{"v":1,"job":"j","rank":0,"epoch":0,"k":"hb","step":1,"t_ns":1,"m":{"a":1' + b"0" * 400 + b"}}", "range"),
    (b'{"v":1,"job":"j","rank":0,"epoch":0,"k":"ckpt","step":1,"t_ns":1,"path":"","files":[]}', "path"),
    (b'{"v":1,"job":"j","rank":0,"epoch":0,"k":"ckpt","step":1,"t_ns":1,"path":"/c","files":[1]}', "files"),
    (b'{"v":1,"job":"j","rank":0,"epoch":0,"k":"resumed","t_ns":1,"via":"disk"}', "via is not one of"),
    (b'{"v":1,"job":"j","rank":0,"epoch":0,"k":"resumed","t_ns":1,"via":"peer","step":-2}', "step"),
]


@pytest.mark.parametrize(("data", "reason"), GARBAGE)
def test_garbage_is_refused_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(MalformedSdkMessage, match=reason):
        parse_message(data)


# --- the real socket with real SDK processes --------------------------------------------------------------------
@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: a Unix socket path must fit in 107 bytes, pytest's tmp_path may not."""
    path = Path(tempfile.mkdtemp(prefix="rp-agent-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def server(short_dir: Path) -> AsyncIterator[SdkServer]:
    sdk_server = SdkServer(short_dir / "run" / "sdk.sock", ProgressBook())
    await sdk_server.start()
    yield sdk_server
    sdk_server.close()


TRAINING = """
import os, sys, time, reprise_sdk
step = 0
while True:
    step += 1
    time.sleep(0.01)
    reprise_sdk.heartbeat(step, loss=1.0 / step)
    if step == int(os.environ.get("CHECKPOINT_AT", "0")):
        with reprise_sdk.phase("checkpointing"):
            reprise_sdk.checkpoint_saved(f"/ckpt/{step}", step, [f"/ckpt/{step}/rank-{os.environ['RANK']}.pt"])
"""


@pytest.fixture
def training(server: SdkServer) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(rank: int, **env: str) -> subprocess.Popen[bytes]:
        rank_env = {
            "REPRISE_SDK_SOCKET": str(server.path),
            "REPRISE_JOB_ID": "job-1",
            "RANK": str(rank),
            "REPRISE_SDK_INTERVAL_S": "0.02",
        }
        proc = subprocess.Popen([sys.executable, "-c", TRAINING], env={**os.environ, **rank_env, **env})
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


async def wait_for(predicate: Callable[[], object], timeout_s: float = 15.0) -> bool:
    return await poll_until(predicate, timeout_s=timeout_s)


async def test_real_ranks_report_steps_phases_and_step_times(
    server: SdkServer, training: Callable[..., subprocess.Popen[bytes]]
) -> None:
    book = server.book
    for rank in range(2):
        training(rank)
    assert await wait_for(lambda: all((book.status_fields("job-1", r)["step"] or 0) >= 30 for r in range(2)))
    for rank in range(2):
        fields = book.status_fields("job-1", rank)
        assert fields["phase"] == "training"
        assert fields["heartbeat_age_s"] < 5
        assert 0.005 < fields["step_time_p50_s"] < 1.0  # each step sleeps 10 ms
        assert 0 < book.metrics("job-1", rank)["loss"] < 1
    assert server.garbage == 0


async def test_a_checkpoint_report_reaches_the_callback(
    server: SdkServer, training: Callable[..., subprocess.Popen[bytes]]
) -> None:
    seen: list[tuple[str, int, int, str, list[str]]] = []
    server.book.on_checkpoint_saved(lambda m: seen.append((m.job_id, m.rank, m.step, m.path, list(m.files))))
    training(1, CHECKPOINT_AT="20")
    assert await wait_for(lambda: bool(seen))
    assert seen == [("job-1", 1, 20, "/ckpt/20", ["/ckpt/20/rank-1.pt"])]
    assert (server.book.status_fields("job-1", 1)["step"] or 0) >= 20  # the held-back heartbeat came first


async def test_a_stopped_rank_ages_while_its_step_stands_still(
    server: SdkServer, training: Callable[..., subprocess.Popen[bytes]]
) -> None:
    book = server.book
    proc = training(0)
    assert await wait_for(lambda: (book.status_fields("job-1", 0)["step"] or 0) >= 5)
    os.kill(proc.pid, signal.SIGSTOP)  # a hang, as the agent sees it
    try:
        await asyncio.sleep(0.3)  # let any datagram already in flight arrive
        frozen = book.status_fields("job-1", 0)
        await asyncio.sleep(1.0)
        later = book.status_fields("job-1", 0)
        assert later["step"] == frozen["step"]
        assert later["heartbeat_age_s"] >= frozen["heartbeat_age_s"] + 0.9
        assert later["phase"] == "training"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert await wait_for(lambda: (book.status_fields("job-1", 0)["step"] or 0) > frozen["step"])
    assert book.status_fields("job-1", 0)["heartbeat_age_s"] < later["heartbeat_age_s"]


async def test_garbage_datagrams_are_counted_and_the_socket_keeps_working(server: SdkServer) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        for data, _ in GARBAGE[:8]:
            sender.sendto(data, str(server.path))
        await asyncio.sleep(0.05)
        good = {"v": 1, "job": "job-2", "rank": 0, "epoch": 0, "k": "hb", "step": 77, "t_ns": 1, "phase": ""}
        sender.sendto(json.dumps(good).encode(), str(server.path))
    assert await wait_for(lambda: server.book.status_fields("job-2", 0)["step"] == 77)
    assert (server.received, server.garbage) == (9, 8)
    assert server.last_garbage == "rank is not a non-negative integer: -1"  # the last garbage sent


async def test_a_stale_socket_file_is_replaced_and_removed_on_close(short_dir: Path) -> None:
    path = short_dir / "sdk.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stale:  # left behind by an agent that died
        stale.bind(str(path))
    sdk_server = SdkServer(path, ProgressBook())
    await sdk_server.start()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.sendto(b'{"v":1,"job":"j","rank":0,"epoch":0,"k":"hb","step":1,"t_ns":1}', str(path))
    assert await wait_for(lambda: sdk_server.book.status_fields("j", 0)["step"] == 1)
    sdk_server.close()
    assert not path.exists()


def test_a_socket_path_too_long_for_unix_sockets_is_refused(short_dir: Path) -> None:
    with pytest.raises(ValueError, match="longer than 107 bytes"):
        SdkServer(short_dir / ("x" * 120) / "sdk.sock", ProgressBook())


def test_the_default_socket_path_is_absolute_and_short_enough(short_dir: Path) -> None:
    assert default_socket_path(short_dir / "agents" / "node-1") == short_dir / "agents" / "node-1" / "sdk.sock"
    deep = short_dir / ("d" * 60) / ("e" * 60)
    path = default_socket_path(deep)
    assert path.is_absolute() and len(os.fsencode(path)) <= 107
    assert path == default_socket_path(deep) != default_socket_path(deep / "other")
    assert default_socket_path(Path("rel")).is_absolute()


def test_checkpoint_digests_are_parsed_and_bad_ones_refused() -> None:
    good = b'{"v":1,"job":"j","rank":0,"epoch":0,"k":"ckpt","step":3,"t_ns":1,"path":"/c","files":["/c/a"],'
    message = parse_message(good + b'"sha256":{"/c/a":[10,"' + b"0f" * 32 + b'"]}}')
    assert message.sha256 == (("/c/a", 10, "0f" * 32),)
    with pytest.raises(MalformedSdkMessage, match="not \\[size, hex digest\\]"):
        parse_message(good + b'"sha256":{"/c/a":"deadbeef"}}')
