"""The PyTorch checkpoint helpers with real PyTorch: files on disk, reports at a real socket, a real gloo group."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the reprise_sdk.torch helpers are not tested")

GlooRanks = Callable[..., list[str]]  # the conftest's gloo_ranks: a script run as every rank
REPORTING_ENV = ["RANK", "REPRISE_JOB_ID", "REPRISE_RESTART_EPOCH", "REPRISE_SDK_SOCKET", "REPRISE_SDK_INTERVAL_S"]


class Reports:
    """The agent's socket, reduced to collecting what the helpers report."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(5)

    def receive(self, count: int) -> list[dict[str, Any]]:
        return [json.loads(self.sock.recv(256 * 1024)) for _ in range(count)]


@pytest.fixture
def reports(monkeypatch: pytest.MonkeyPatch) -> Iterator[Reports]:
    directory = Path(tempfile.mkdtemp(prefix="rp-torch-", dir="/tmp"))
    receiver = Reports(directory / "sdk.sock")
    for name in REPORTING_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("REPRISE_SDK_SOCKET", str(receiver.path))
    monkeypatch.setenv("REPRISE_JOB_ID", "job-t")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")  # a lone rank of a larger world, without a process group
    yield receiver
    receiver.sock.close()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def helpers(reports: Reports) -> Iterator[ModuleType]:
    from reprise_sdk import _client
    from reprise_sdk import torch as helpers

    _client._reset()
    yield helpers
    _client._reset()


def test_per_rank_checkpoint_round_trip_is_reported(helpers: ModuleType, reports: Reports, tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 40, "lr": 0.1}
    files = helpers.save_checkpoint(tmp_path / "step-40", 40, state)

    target = (tmp_path / "step-40" / "rank-00002.pt").absolute()
    assert files == [str(target)]
    assert sorted(p.name for p in target.parent.iterdir()) == ["rank-00002.pt"]  # no partial file left behind
    loaded = helpers.load_checkpoint(tmp_path / "step-40")
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["step"] == 40
    enter, leave, saved = reports.receive(3)
    assert (enter["k"], enter["phase"], leave["k"], leave["phase"]) == ("phase", "checkpointing", "phase", "")
    assert (saved["k"], saved["rank"], saved["step"]) == ("ckpt", 2, 40)
    assert saved["path"] == str(target.parent) and saved["files"] == files
    content = target.read_bytes()
    assert saved["sha256"] == {str(target): [len(content), hashlib.sha256(content).hexdigest()]}


PER_RANK = """
import json, os, sys, torch, torch.distributed as dist
from reprise_sdk.torch import save_checkpoint
dist.init_process_group("gloo")
files = save_checkpoint(sys.argv[1], 7, {"w": torch.full((2,), float(dist.get_rank()))})
print(json.dumps(files))
sys.stdout.flush()
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # gloo's threads now and then abort the interpreter's exit (SIGABRT); not what these tests are about
"""


def test_per_rank_checkpoint_is_committed_once_every_rank_saved(gloo_ranks: GlooRanks, tmp_path: Path) -> None:
    gloo_ranks(PER_RANK, str(tmp_path / "step-7"))
    assert sorted(p.name for p in (tmp_path / "step-7").iterdir()) == ["COMMITTED", "rank-00000.pt", "rank-00001.pt"]


def test_a_lone_rank_of_a_larger_world_does_not_commit(helpers: ModuleType, tmp_path: Path) -> None:
    helpers.save_checkpoint(tmp_path / "s", 1, {"w": torch.ones(1)}, rank=0)
    assert [p.name for p in (tmp_path / "s").iterdir()] == ["rank-00000.pt"]


def test_a_one_rank_job_commits_at_once(helpers: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    helpers.save_checkpoint(tmp_path / "s", 1, {"w": torch.ones(1)}, rank=0)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["COMMITTED", "rank-00000.pt"]


def test_a_save_that_fails_leaves_the_previous_file_intact(helpers: ModuleType, tmp_path: Path) -> None:
    helpers.save_checkpoint(tmp_path, 1, {"w": torch.ones(2)}, rank=0)
    with pytest.raises(Exception, match="pickle"):
        helpers.save_checkpoint(tmp_path, 2, {"w": torch.zeros(2), "bad": lambda: None}, rank=0)
    assert torch.equal(helpers.load_checkpoint(tmp_path, rank=0)["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["rank-00000.pt"]


def test_distributed_checkpoint_round_trip_without_a_process_group(
    helpers: ModuleType, reports: Reports, tmp_path: Path
) -> None:
    state = {"w": torch.arange(4.0), "nested": {"b": torch.full((2,), 7.0)}}
    files = helpers.save_distributed(tmp_path / "dcp", 9, state)

    assert [Path(f).name for f in files] == [".metadata", "__0_0.distcp"]
    assert all(Path(f).is_file() for f in files)
    target = {"w": torch.zeros(4), "nested": {"b": torch.zeros(2)}}
    helpers.load_distributed(tmp_path / "dcp", target)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["nested"]["b"], state["nested"]["b"])
    saved = reports.receive(3)[2]
    assert (saved["k"], saved["step"], saved["files"]) == ("ckpt", 9, files)


GLOO_RANK = """
import json, os, sys, torch, torch.distributed as dist
from reprise_sdk.torch import save_distributed, load_distributed
dist.init_process_group("gloo")
rank = dist.get_rank()
own = f"rank{rank}"  # a key only this rank holds: each rank writes a file of its own
files = save_distributed(sys.argv[1], 5, {own: torch.full((3,), float(rank)), "shared": torch.ones(2)})
state = {own: torch.zeros(3), "shared": torch.zeros(2)}
load_distributed(sys.argv[1], state)
print(json.dumps({"rank": rank, "files": files, "own": state[own].tolist(), "shared": state["shared"].tolist()}))
sys.stdout.flush()
dist.barrier()  # rank 0 hosts the store: nobody may tear down while a peer still talks to it
dist.destroy_process_group()
os._exit(0)  # gloo's threads now and then abort the interpreter's exit (SIGABRT); not what these tests are about
"""


def test_distributed_checkpoint_reports_each_ranks_own_files(gloo_ranks: GlooRanks, tmp_path: Path) -> None:
    outputs = [json.loads(out.strip().splitlines()[-1]) for out in gloo_ranks(GLOO_RANK, str(tmp_path / "dcp"))]
    by_rank = {o["rank"]: o for o in outputs}
    assert [Path(f).name for f in by_rank[0]["files"]] == [".metadata", "__0_0.distcp"]
    assert [Path(f).name for f in by_rank[1]["files"]] == ["__1_0.distcp"]
    assert by_rank[1]["own"] == [1.0, 1.0, 1.0] and by_rank[1]["shared"] == [1.0, 1.0]


def _manifest(monkeypatch: pytest.MonkeyPatch, directory: Path, files: list[str], tmp_path: Path) -> None:
    """What the agent hands a rank that restores `directory`: the registry's digests of its files."""
    entries = []
    for name in files:
        data = (directory / name).read_bytes()
        entries.append(
            {"path": name, "size_bytes": len(data), "algorithm": "sha256", "digest": hashlib.sha256(data).hexdigest()}
        )
    listing = tmp_path / "resume-files.json"
    listing.write_text(json.dumps(entries))
    monkeypatch.setenv("REPRISE_RESUME_CHECKPOINT", str(directory))
    monkeypatch.setenv("REPRISE_RESUME_FILES", str(listing))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - 20] ^= 0x01  # inside the zip's last entry data: same size, torch.load may not notice
    path.write_bytes(bytes(data))


def test_a_restored_file_that_differs_from_the_validated_digest_is_refused(
    helpers: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from reprise_sdk import CheckpointCorruptError

    directory = tmp_path / "step-40"
    helpers.save_checkpoint(directory, 40, {"w": torch.arange(1000.0)})
    _manifest(monkeypatch, directory, ["rank-00002.pt"], tmp_path)
    assert torch.equal(helpers.load_checkpoint(directory)["w"], torch.arange(1000.0))  # intact: loads

    _flip_byte(directory / "rank-00002.pt")
    with pytest.raises(CheckpointCorruptError, match=r"rank-00002\.pt: sha256 .* differs from the validated"):
        helpers.load_checkpoint(directory)
    (directory / "rank-00002.pt").write_bytes(b"short")
    with pytest.raises(CheckpointCorruptError, match="is 5 bytes; the registry validated"):
        helpers.load_checkpoint(directory)
    (directory / "rank-00002.pt").unlink()
    with pytest.raises(CheckpointCorruptError, match="is missing"):
        helpers.load_checkpoint(directory)
    with pytest.raises(CheckpointCorruptError, match="not a file of the validated checkpoint"):
        helpers.load_checkpoint(directory, rank=0)  # a file the registry never validated


def test_another_directory_than_the_restored_one_is_not_checked(
    helpers: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    helpers.save_checkpoint(tmp_path / "a", 1, {"w": torch.ones(3)})
    helpers.save_checkpoint(tmp_path / "b", 2, {"w": torch.zeros(3)})
    _manifest(monkeypatch, tmp_path / "a", ["rank-00002.pt"], tmp_path)
    assert torch.equal(helpers.load_checkpoint(tmp_path / "b")["w"], torch.zeros(3))


def test_a_distributed_checkpoint_is_checked_before_it_is_loaded(
    helpers: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from reprise_sdk import CheckpointCorruptError

    files = helpers.save_distributed(tmp_path / "dcp", 9, {"w": torch.arange(64.0)})
    _manifest(monkeypatch, tmp_path / "dcp", [Path(f).name for f in files], tmp_path)
    target = {"w": torch.zeros(64)}
    helpers.load_distributed(tmp_path / "dcp", target)
    assert torch.equal(target["w"], torch.arange(64.0))

    _flip_byte(tmp_path / "dcp" / "__0_0.distcp")
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp"):
        helpers.load_distributed(tmp_path / "dcp", {"w": torch.zeros(64)})


def test_a_kept_copy_with_the_validated_digest_is_restored_from_memory_and_nothing_else_is(
    helpers: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from reprise_sdk import CheckpointCorruptError

    monkeypatch.setenv("REPRISE_SDK_KEEP_BYTES", str(1 << 20))
    older, newer = tmp_path / "step-10", tmp_path / "step-20"
    helpers.save_checkpoint(older, 10, {"w": torch.arange(100.0)})
    helpers.save_checkpoint(newer, 20, {"w": torch.arange(200.0)})  # the newest is the one kept
    _manifest(monkeypatch, newer, ["rank-00002.pt"], tmp_path)
    (newer / "rank-00002.pt").unlink()  # storage gone: only the copy in memory can serve it
    before = helpers.kept.restored
    assert torch.equal(helpers.load_checkpoint(newer)["w"], torch.arange(200.0))
    assert helpers.kept.restored == before + 1

    _manifest(monkeypatch, older, ["rank-00002.pt"], tmp_path)  # a restore of an older one: not in memory
    _flip_byte(older / "rank-00002.pt")
    with pytest.raises(CheckpointCorruptError, match="differs from the validated"):
        helpers.load_checkpoint(older)  # storage is read and checked, as always


def test_nothing_is_kept_without_the_setting_or_above_its_size(
    helpers: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from reprise_sdk import CheckpointCorruptError

    for keep in ("", "64"):  # off, and smaller than the file
        monkeypatch.setenv("REPRISE_SDK_KEEP_BYTES", keep)
        directory = tmp_path / f"step-{keep or 0}"
        helpers.save_checkpoint(directory, 1, {"w": torch.arange(100.0)})
        assert helpers.kept.by_digest == {}
        _manifest(monkeypatch, directory, ["rank-00002.pt"], tmp_path)
        (directory / "rank-00002.pt").unlink()
        with pytest.raises(CheckpointCorruptError, match="is missing"):
            helpers.load_checkpoint(directory)


# Background saves: the training thread copies, the SDK's writer thread writes, commits and reports.

BACKGROUND_RANKS = """
import json, os, sys, torch, torch.distributed as dist
from reprise_sdk.torch import background_stats, load_checkpoint, load_distributed, save_checkpoint, save_distributed
dist.init_process_group("gloo")
rank = dist.get_rank()
root = sys.argv[1]
state = {"w": torch.full((4,), float(rank)), "opt": {"step": 7, "m": [torch.ones(2)]}}
per_rank = save_checkpoint(f"{root}/per-rank", 7, state, background=True)
dcp = save_distributed(f"{root}/dcp", 7, {f"own{rank}": state["w"]}, background=True)  # waits for per_rank first
first_done_before_second_began = per_rank.done()
state["w"].add_(100.0)  # training goes on: the saves hold the state as it was
dist.all_reduce(state["w"])  # the training group is free while the writer thread commits on its own group
files = per_rank.wait(60) + dcp.wait(60)
loaded = load_checkpoint(f"{root}/per-rank")
back = {f"own{rank}": torch.zeros(4)}
load_distributed(f"{root}/dcp", back)
print(json.dumps({"rank": rank, "files": files, "w": loaded["w"].tolist(), "dcp": back[f"own{rank}"].tolist(),
                  "first_done": first_done_before_second_began, "saves": background_stats().saves}))
sys.stdout.flush()
dist.barrier()
dist.destroy_process_group()
os._exit(0)
"""


def test_background_saves_hold_the_state_of_their_step_and_commit_on_their_own_group(
    gloo_ranks: GlooRanks, tmp_path: Path
) -> None:
    outputs = [json.loads(out.strip().splitlines()[-1]) for out in gloo_ranks(BACKGROUND_RANKS, str(tmp_path))]
    for rank, out in enumerate(outputs):
        assert out["w"] == [float(rank)] * 4 and out["dcp"] == [float(rank)] * 4  # not the +100 made after the call
        assert out["first_done"] and out["saves"] == 2
    assert sorted(p.name for p in (tmp_path / "per-rank").iterdir()) == ["COMMITTED", "rank-00000.pt", "rank-00001.pt"]
    assert [Path(f).name for f in outputs[0]["files"]] == ["rank-00000.pt", ".metadata", "__0_0.distcp"]


def test_a_background_save_is_reported_with_the_digest_of_the_file(helpers: ModuleType, reports: Reports) -> None:
    directory = reports.path.parent / "step-3"
    pending = helpers.save_checkpoint(directory, 3, {"w": torch.arange(5.0)}, rank=2, background=True)
    files = pending.wait(30)
    kinds_then_ckpt = reports.receive(3)  # the copy's phase, in and out, then the writer thread's report
    assert [m["k"] for m in kinds_then_ckpt] == ["phase", "phase", "ckpt"]
    saved = kinds_then_ckpt[2]
    data = Path(files[0]).read_bytes()
    assert (saved["k"], saved["step"], saved["files"]) == ("ckpt", 3, files)
    assert saved["sha256"] == {files[0]: [len(data), hashlib.sha256(data).hexdigest()]}
    stats = helpers.background_stats()
    assert stats.held_bytes == stats.peak_bytes == 20  # five float32: the host copy, kept for the next save


def test_the_next_background_save_copies_into_the_same_host_buffers(helpers: ModuleType, tmp_path: Path) -> None:
    from reprise_sdk import _background

    state = {"w": torch.arange(4.0), "b": torch.zeros(2)}
    helpers.save_checkpoint(tmp_path / "1", 1, state, rank=0, background=True).wait(30)
    first = [t.data_ptr() for t in _background.writer.staging]
    state["w"].add_(1.0)
    helpers.save_checkpoint(tmp_path / "2", 2, state, rank=0, background=True).wait(30)
    assert [t.data_ptr() for t in _background.writer.staging] == first
    assert helpers.load_checkpoint(tmp_path / "2", rank=0)["w"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert helpers.load_checkpoint(tmp_path / "1", rank=0)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_state_over_the_bound_is_saved_synchronously(
    helpers: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("REPRISE_SDK_BACKGROUND_MAX_BYTES", "16")
    pending = helpers.save_checkpoint(tmp_path / "s", 1, {"w": torch.ones(8)}, rank=0, background=True)
    assert pending.done() and pending.wait(0) == [str(tmp_path / "s" / "rank-00000.pt")]
    assert "saved synchronously" in capfd.readouterr().err


KILLED_MID_SAVE = """
import os, sys, time, torch
stall = sys.argv[2]
if stall == "fsync":  # the bytes are written, not yet synced nor renamed
    os.fsync = lambda fd: time.sleep(600)
import reprise_sdk.torch as helpers
if stall == "commit":  # the file is in place, the marker not yet written
    helpers._write_marker = lambda directory: time.sleep(600)
helpers.save_checkpoint(sys.argv[1], 5, {"w": torch.ones(1 << 20)}, rank=0, background=True)
print("saving", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("stall", ["fsync", "commit"])
def test_a_background_save_killed_mid_way_is_never_reported_nor_committed(
    reports: Reports, tmp_path: Path, stall: str
) -> None:
    directory = tmp_path / "step-5"
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_SAVE, str(directory), stall], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "saving"
        written = "rank-00000.pt" if stall == "commit" else ".partial"
        for _ in range(3000):  # until the writer thread is stuck where the test put it
            if directory.is_dir() and any(written in p.name for p in directory.iterdir()):
                break
            time.sleep(0.01)
        else:
            pytest.fail(f"the writer thread never reached its {stall}")
    finally:
        proc.kill()
        proc.wait(30)
    assert "COMMITTED" not in [p.name for p in directory.iterdir()]
    reports.sock.settimeout(0.5)
    kinds = []
    with contextlib.suppress(TimeoutError):
        while True:
            kinds.append(json.loads(reports.sock.recv(65536))["k"])
    assert "ckpt" not in kinds
