"""Fixtures of the SDK's tests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: a Unix socket path must fit in 107 bytes, pytest's tmp_path may not."""
    path = Path(tempfile.mkdtemp(prefix="rp-sdk-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


_REPORTING_ENV = ["RANK", "REPRISE_JOB_ID", "REPRISE_RESTART_EPOCH", "REPRISE_SDK_SOCKET", "REPRISE_SDK_INTERVAL_S"]


@pytest.fixture
def gloo_ranks() -> Callable[..., list[str]]:
    """Runs a script as every rank of a gloo process group on this machine: `gloo_ranks(script, *args, world_size=2)`
    returns each rank's stdout, in rank order."""
    return _run_gloo_ranks


def _run_gloo_ranks(script: str, *args: str, world_size: int = 2) -> list[str]:
    """Run `script` as every rank of a gloo process group on this machine; each rank's stdout, in rank order."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in _REPORTING_ENV}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *args],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err
        outputs.append(out)
    return outputs
