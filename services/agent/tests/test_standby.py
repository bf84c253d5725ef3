"""Warm standbys: real interpreters that preload modules, wait, and then run a rank's script as `python` would."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from reprise_agent.launch.standby import StandbyPool
from reprise_common.procs import process_alive

SCRIPT = """
import json, os, sys
import helper  # beside the script: sys.path[0] must be the script's directory
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "rank": os.environ.get("RANK"), "name": __name__,
                  "helper": helper.VALUE, "preloaded": "decimal" in sys.modules, "stdin": sys.stdin.read()}))
sys.exit(int(os.environ.get("EXIT_WITH", "0")))
"""


@pytest.fixture
async def pool() -> AsyncIterator[StandbyPool]:
    started = StandbyPool(python=sys.executable, size=1, preload=["decimal", "no_such_module_here"])
    started.start()
    yield started
    await started.close()


async def ready(pool: StandbyPool, count: int = 1) -> list[int]:
    """The pids of the ready standbys once there are `count` of them."""
    for _ in range(600):
        found = [s.pid for s in pool.statuses() if s.ready]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"no ready standby: {pool.statuses()}")


async def run(proc: asyncio.subprocess.Process) -> tuple[str, int]:
    assert proc.stdout is not None
    out = (await proc.stdout.read()).decode()
    return out, await proc.wait()


async def test_a_standby_runs_the_script_as_python_would_and_the_pool_refills(
    pool: StandbyPool, tmp_path: Path
) -> None:
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "train.py").write_text(SCRIPT)
    (tmp_path / "job" / "helper.py").write_text("VALUE = 7\n")
    [first] = await ready(pool)
    [status] = pool.statuses()
    assert status.rss_bytes and status.rss_bytes > 1_000_000
    assert status.failed_imports and status.failed_imports[0].startswith("no_such_module_here: ModuleNotFoundError")

    env = {**os.environ, "RANK": "3", "EXIT_WITH": "5"}
    proc = await pool.take([sys.executable, "job/train.py", "--steps", "9"], env, str(tmp_path))
    assert proc is not None and proc.pid == first
    out, code = await run(proc)
    said = __import__("json").loads(out.strip().splitlines()[-1])
    assert code == 5
    assert said == {
        "argv": [str(tmp_path / "job" / "train.py"), "--steps", "9"],  # absolute, like __file__
        "cwd": str(tmp_path),
        "rank": "3",
        "name": "__main__",
        "helper": 7,
        "preloaded": True,
        "stdin": "",
    }
    [second] = await ready(pool)  # a new one took its place
    assert second != first and pool.taken == 1


async def test_a_module_runs_on_a_standby_with_its_arguments(pool: StandbyPool, tmp_path: Path) -> None:
    await ready(pool)
    proc = await pool.take([sys.executable, "-m", "json.tool", "--indent", "1"], dict(os.environ), str(tmp_path))
    assert proc is not None
    out, code = await run(proc)  # json.tool reads stdin: the rank's stdin is empty, so it fails cleanly
    assert code != 0 and "Expecting value" in out


@pytest.mark.parametrize(
    ("command", "env_change", "why"),
    [
        (["/usr/bin/env", "python3", "x.py"], {}, "not the standbys' interpreter"),
        ([sys.executable, "-u", "x.py"], {}, "not a script or -m module"),
        ([sys.executable], {}, "not a script or -m module"),
        ([sys.executable, "x.py"], {"PYTHONHASHSEED": "1"}, "PYTHONHASHSEED"),
        ([sys.executable, "x.py"], {"OMP_NUM_THREADS": "3"}, "OMP_NUM_THREADS"),
    ],
)
async def test_what_a_standby_cannot_run_starts_cold(
    pool: StandbyPool, command: list[str], env_change: dict[str, str], why: str
) -> None:
    await ready(pool)
    env = {k: v for k, v in os.environ.items() if k not in env_change} | env_change
    assert why in pool.unfit(command, env)
    assert await pool.take(command, env, None) is None
    assert pool.taken == 0 and len(pool.statuses()) == 1  # the standby still waits


async def test_closing_the_pool_ends_every_standby() -> None:
    pool = StandbyPool(python=sys.executable, size=2, preload=[])
    pool.start()
    pids = await ready(pool, 2)
    await pool.close()
    assert not any(process_alive(pid) for pid in pids)
    assert await pool.take([sys.executable, "x.py"], dict(os.environ), None) is None


async def test_a_used_standby_is_replaced_only_after_the_refill_delay(tmp_path: Path) -> None:
    pool = StandbyPool(python=sys.executable, size=1, preload=[], refill_delay_s=3600)
    pool.start()
    try:
        [first] = await ready(pool)
        (tmp_path / "quick.py").write_text("pass\n")
        proc = await pool.take([sys.executable, str(tmp_path / "quick.py")], dict(os.environ), None)
        assert proc is not None and proc.pid == first
        await run(proc)
        await asyncio.sleep(0.5)
        assert pool.statuses() == []  # the ranks that took standbys start without a new import beside them
    finally:
        await pool.close()
