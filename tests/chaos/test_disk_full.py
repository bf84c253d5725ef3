"""Chaos: the disk fills up while a rank saves a checkpoint (a real 2 MiB tmpfs, as root).

What must hold: the save fails loudly (OSError ENOSPC reaches the training script), leaves no partial file, does not
report the checkpoint (the registry never sees it), and the previous checkpoint on the same disk stays intact and
loadable — so the recovery that follows restores it.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the SDK's checkpoint helpers are not tested")
pytestmark = pytest.mark.chaos


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True, check=False
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_save_that_fills_the_disk_fails_reports_nothing_and_keeps_the_previous_checkpoint(
    small_disk: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from reprise_sdk import _client
    from reprise_sdk.torch import load_checkpoint, save_checkpoint

    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # the agent's SDK socket, reduced to a recorder
    agent.bind(str(tmp_path / "sdk.sock"))
    agent.settimeout(0.5)
    for name, value in {"REPRISE_SDK_SOCKET": str(tmp_path / "sdk.sock"), "REPRISE_JOB_ID": "job-d", "RANK": "0",
                        "WORLD_SIZE": "1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    _client._reset()
    try:
        save_checkpoint(small_disk / "step-10", 10, {"w": torch.arange(1000.0)})  # 4 KB: fits
        with pytest.raises(OSError) as failed:
            save_checkpoint(small_disk / "step-20", 20, {"w": torch.zeros(1_000_000)})  # 4 MB: does not
        reports = []
        while True:
            try:
                reports.append(json.loads(agent.recv(256 * 1024)))
            except TimeoutError:
                break
    finally:
        _client._reset()
        agent.close()

    assert failed.value.errno == errno.ENOSPC and "no space left on the device saving" in str(failed.value)
    assert sorted(p.name for p in (small_disk / "step-20").iterdir()) == []  # no partial file, no marker
    assert [r["step"] for r in reports if r["k"] == "ckpt"] == [10]  # the failed save was never reported
    assert torch.equal(load_checkpoint(small_disk / "step-10")["w"], torch.arange(1000.0))
    assert os.path.exists(small_disk / "step-10" / "COMMITTED")
