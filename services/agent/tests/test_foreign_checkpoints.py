"""Checkpoints a script saves itself: the agent's watcher finds a real torch.save file, a real
torch.distributed.checkpoint directory and a Hugging Face-style checkpoint-N directory once each is complete and
stable, never one still being written; and a restore reaches the script through its arguments and environment, or,
when the restored bytes differ, starts no rank and says why (real files, real NATS, real rank processes)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from reprise_agent.foreign_checkpoints import CheckpointWatcher, Scope
from reprise_cli.servers import NatsServer
from reprise_common.events import RESTORE_REFUSED, CheckpointSaved, CheckpointWatch, CommandResult, ResumeFile

from .test_agent import running_agent, wait_for

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
ALL_RANKS = Scope(frozenset({0}), world_size=2, restart_epoch=3)


def _watcher(directory: Path, layout: str, pattern: str, scope: Scope = ALL_RANKS) -> CheckpointWatcher:
    watch = CheckpointWatch(directory=str(directory), layout=layout, pattern=pattern)
    return CheckpointWatcher("job-1", "n1", watch, scope)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digests(event: CheckpointSaved) -> dict[str, tuple[int, str]]:
    return {d.path: (d.size_bytes, d.digest) for d in event.file_digests}


def test_a_torch_save_file_is_reported_once_it_is_stable_and_what_was_there_before_never(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(3)}, tmp_path / "snapshot-5.pt")  # an earlier launch's: not this watcher's
    watcher = _watcher(tmp_path, "file", "snapshot-{step}.pt")
    assert watcher.poll() == []
    torch.save({"w": torch.arange(1000.0)}, tmp_path / "snapshot-10.pt")
    (tmp_path / "notes-10.txt").write_text("not a checkpoint")
    assert watcher.poll() == []  # first seen: it may still be written
    [event] = watcher.poll()
    path = tmp_path / "snapshot-10.pt"
    assert (event.step, event.rank, event.world_size, event.restart_epoch) == (10, 0, 1, 3)
    assert (event.path, event.files, event.marker) == (str(tmp_path), ["snapshot-10.pt"], "snapshot-10.pt")
    assert _digests(event) == {"snapshot-10.pt": (path.stat().st_size, _sha256(path))}
    assert all(d.algorithm == "sha256" for d in event.file_digests)
    assert watcher.poll() == []  # reported once


def test_a_file_still_growing_is_not_reported_until_it_stops(tmp_path: Path) -> None:
    watcher = _watcher(tmp_path, "file", "snapshot-{step}.pt")
    watcher.poll()
    path = tmp_path / "snapshot-20.pt"
    with path.open("wb") as torn:
        for _ in range(3):
            torn.write(os.urandom(4096))
            torn.flush()
            assert watcher.poll() == []  # a torn file: another size at every poll
    [event] = watcher.poll()  # the same size and mtime twice in a row
    assert _digests(event) == {"snapshot-20.pt": (3 * 4096, _sha256(path))}


def test_a_symlink_named_like_a_checkpoint_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path.parent / f"{tmp_path.name}-secret"
    outside.write_bytes(b"secret")
    watcher = _watcher(tmp_path, "file", "snapshot-{step}.pt")
    watcher.poll()
    (tmp_path / "snapshot-30.pt").symlink_to(outside)
    assert watcher.poll() == [] and watcher.poll() == []


def test_a_dcp_directory_is_reported_only_once_its_metadata_is_written(tmp_path: Path) -> None:
    watcher = _watcher(tmp_path, "dcp", "step-{step}")
    watcher.poll()
    target = tmp_path / "step-40"
    dcp.save({"model": {"w": torch.arange(64.0), "b": torch.zeros(2)}}, checkpoint_id=str(target))
    metadata = target / ".metadata"
    held = metadata.read_bytes()
    metadata.unlink()  # as the coordinator has not written it yet
    assert watcher.poll() == [] and watcher.poll() == []
    metadata.write_bytes(held)
    assert watcher.poll() == []
    [event] = watcher.poll()
    assert event.path == str(target) and event.marker is None  # the registry's default for DCP: .metadata
    assert ".metadata" in event.files and any(f.endswith(".distcp") for f in event.files)
    assert _digests(event) == {f: ((target / f).stat().st_size, _sha256(target / f)) for f in event.files}


def test_an_hf_checkpoint_directory_is_reported_once_its_trainer_state_is_written(tmp_path: Path) -> None:
    watcher = _watcher(tmp_path, "hf", "checkpoint-{step}")
    watcher.poll()
    target = tmp_path / "checkpoint-50"
    target.mkdir()
    (target / "model.safetensors").write_bytes(os.urandom(8192))
    torch.save({"state": {}}, target / "optimizer.pt")
    (target / "runs").mkdir()
    (target / "runs" / "events.out").write_bytes(b"log")
    assert watcher.poll() == [] and watcher.poll() == []  # Trainer writes trainer_state.json after these
    (target / "trainer_state.json").write_text(json.dumps({"global_step": 50}))
    watcher.poll()
    [event] = watcher.poll()
    assert (event.step, event.marker, event.world_size) == (50, "trainer_state.json", 1)
    assert sorted(event.files) == ["model.safetensors", "optimizer.pt", "runs/events.out", "trainer_state.json"]


def test_per_rank_files_are_reported_by_the_agent_of_each_rank(tmp_path: Path) -> None:
    scope = Scope(frozenset({2, 3}), world_size=4, restart_epoch=0)
    watcher = _watcher(tmp_path, "per_rank", "model-{step}-rank{rank}.pt", scope)
    watcher.poll()
    for rank in range(4):
        torch.save({"rank": rank}, tmp_path / f"model-60-rank{rank}.pt")
    watcher.poll()
    events = sorted(watcher.poll(), key=lambda e: e.rank)
    assert [(e.rank, e.step, e.world_size, e.files, e.marker) for e in events] == [
        (2, 60, 4, ["model-60-rank2.pt"], "model-60-rank2.pt"),
        (3, 60, 4, ["model-60-rank3.pt"], "model-60-rank3.pt"),
    ]


# --- the agent: reports over NATS, and restores ------------------------------------------------------------------
WRITER = (
    "import os, sys, time\n"
    "d = sys.argv[1]\n"
    "open(os.path.join(d, 'snapshot-70.pt.tmp'), 'wb').write(os.urandom(5000))\n"
    "os.replace(os.path.join(d, 'snapshot-70.pt.tmp'), os.path.join(d, 'snapshot-70.pt'))\n"
    "time.sleep(600)\n"
)
SHOWS_ITS_START = (
    "import json, os, sys\n"
    "print('START ' + json.dumps({'argv': sys.argv[1:], 'resume': os.environ.get('RESUME_FROM')}), flush=True)\n"
    "import time; time.sleep(600)\n"
)


async def test_the_agent_reports_a_scripts_checkpoint_over_nats(nats_server: NatsServer, tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    watch = {"directory": str(directory), "layout": "file", "pattern": "snapshot-{step}.pt", "poll_s": 0.2}
    async with running_agent(nats_server, tmp_path, report_interval_s=0.5) as harness:
        command = [sys.executable, "-c", WRITER, str(directory)]
        reply = await harness.launch(fence=1, command_id="l", gpus=(0,), command=command, checkpoints=watch)
        assert reply.result is CommandResult.DONE, reply.detail
        assert await wait_for(lambda: harness.of_type(CheckpointSaved), timeout_s=15)
        [event] = harness.of_type(CheckpointSaved)
        assert isinstance(event, CheckpointSaved)
        written = directory / "snapshot-70.pt"
        assert (event.job_id, event.node_id, event.step) == ("job-1", "n1", 70)
        assert _digests(event) == {"snapshot-70.pt": (5000, _sha256(written))}
        assert harness.agent.foreign.watching() == ["job-1"]


def _restore_launch(directory: Path, file: Path, **watch: object) -> dict[str, object]:
    section = {"directory": str(directory), "layout": "file", "pattern": "snapshot-{step}.pt"} | watch
    resumed = ResumeFile(path=file.name, size_bytes=file.stat().st_size, algorithm="sha256", digest=_sha256(file))
    return {
        "resume_checkpoint": str(directory),
        "resume_files": [resumed.model_dump()],
        "checkpoints": section,
        "command": [sys.executable, "-c", SHOWS_ITS_START],
        "gpus": (0,),
    }


def _log(tmp_path: Path, epoch: int) -> str:
    path = tmp_path / "agent" / "ranks" / "job-1" / f"epoch-{epoch}-rank-0.log"
    return path.read_text() if path.exists() else ""


async def test_a_restore_reaches_the_script_through_its_arguments_and_environment(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    file = directory / "snapshot-80.pt"
    torch.save({"w": torch.ones(4)}, file)
    launch = _restore_launch(
        directory, file, restore_args=["--resume", "{restore_path}", "--step={restore_step}"], restore_env="RESUME_FROM"
    )
    async with running_agent(nats_server, tmp_path, report_interval_s=0.5) as harness:
        reply = await harness.launch(fence=1, command_id="l", restart_epoch=1, **launch)  # type: ignore[arg-type]
        assert reply.result is CommandResult.DONE, reply.detail
        assert await wait_for(lambda: "START" in _log(tmp_path, 1), timeout_s=15)
    started = json.loads(_log(tmp_path, 1).split("START ", 1)[1].splitlines()[0])
    assert started == {"argv": ["--resume", str(file), "--step=80"], "resume": str(file)}


@pytest.mark.parametrize("damage", ["flip", "truncate", "symlink"])
async def test_a_damaged_restore_starts_no_rank_and_the_launch_says_why(
    nats_server: NatsServer, tmp_path: Path, damage: str
) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    file = directory / "snapshot-90.pt"
    torch.save({"w": torch.ones(4)}, file)
    launch = _restore_launch(directory, file, restore_args=["--resume", "{restore_path}"])
    data = bytearray(file.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01  # same size: only a digest tells
    elif damage == "truncate":
        del data[-10:]
    else:  # the same bytes, but through a link that could be pointed anywhere
        (tmp_path / "elsewhere.pt").write_bytes(bytes(data))
        file.unlink()
        file.symlink_to(tmp_path / "elsewhere.pt")
    if damage != "symlink":
        file.write_bytes(bytes(data))
    async with running_agent(nats_server, tmp_path, report_interval_s=0.5) as harness:
        reply = await harness.launch(fence=1, command_id="l", restart_epoch=1, **launch)  # type: ignore[arg-type]
        assert not harness.agent.supervisor.ranks()  # no rank started on it
    assert reply.result is CommandResult.FAILED
    why = {
        "flip": "digest: snapshot-90.pt",
        "truncate": "size: snapshot-90.pt",
        "symlink": "not_a_file: snapshot-90.pt",
    }
    assert reply.data[RESTORE_REFUSED].startswith(why[damage]), reply.data
    assert "refused before launch" in reply.detail
    assert "START" not in _log(tmp_path, 1)  # the script never ran on the damaged checkpoint
