"""The process launcher on real processes: a rank's environment over the agent's, its output and exit code, a signal
that killed it as a negative code, and signals that reach everything it started."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from reprise_agent.launch.processes import ProcessLauncher
from reprise_common.aio import poll_until
from reprise_common.procs import ProcessSample, process_alive

STUBBORN_CHILD = (  # argv[1]: the file the child creates once it ignores SIGTERM
    "import pathlib, signal, subprocess, sys, time\n"
    "code = 'import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "pathlib.Path(sys.argv[1]).touch(); time.sleep(60)'\n"
    "child = subprocess.Popen([sys.executable, '-c', code, sys.argv[1]], stdout=subprocess.DEVNULL, "
    "stderr=subprocess.DEVNULL)\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(60)\n"
)


async def test_a_rank_finds_its_env_over_the_agents_and_its_exit_code_is_reported(tmp_path: Path) -> None:
    code = "import os, sys; print(os.environ['RANK'], os.getcwd(), 'PATH' in os.environ); sys.exit(3)"
    handle = await ProcessLauncher().start(
        [sys.executable, "-c", code], env={"RANK": "5"}, cwd=str(tmp_path), warm=True
    )
    out = (await handle.output.read()).decode().split()
    assert out == ["5", str(tmp_path), "True"]
    assert await handle.wait() == 3 and handle.returncode == 3
    assert not handle.warm and not handle.oom_killed()  # no standbys: it started cold
    assert handle.record() == {"pid": handle.pid, "started": handle.record()["started"]}


async def test_a_frozen_rank_stops_on_terminate_and_kill_reaches_what_it_started(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    launcher = ProcessLauncher()
    handle = await launcher.start([sys.executable, "-c", STUBBORN_CHILD, str(ready)], env={}, cwd=None, warm=False)
    child = int(await handle.output.readline())
    assert await poll_until(ready.exists, timeout_s=10)
    handle.signal(signal.SIGSTOP)
    assert await poll_until(lambda: (handle.usage() or ProcessSample("", 0)).state == "T", timeout_s=10)
    handle.terminate()
    assert await asyncio.wait_for(handle.wait(), 10) == -signal.SIGTERM  # a signal is a negative code
    assert handle.usage() is None and process_alive(child)  # the child ignores SIGTERM: it outlived its leader
    handle.kill()
    assert await poll_until(lambda: not process_alive(child), timeout_s=10)
