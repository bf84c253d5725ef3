"""The container launcher on a real dockerd: a rank's exit code, a signal death as a negative code (137 is SIGKILL),
the container's OOM kill as its own cause, signals that reach the rank, its labels and limits, and a missing image
or a refused spec as a clear, non-retryable error."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import docker
import pytest

from reprise_agent.launch.container_policy import ContainerPolicy, DockerUnavailableError, LaunchRefusedError
from reprise_agent.launch.containers import ContainerEngine, ContainerHandle
from reprise_agent.stacks import capture, find_py_spy
from reprise_common.aio import poll_until
from reprise_common.events import ContainerSpec, LaunchArgs, RankAssignment
from reprise_common.procs import ProcessSample
from reprise_common.thread_stacks import top_frame

from .conftest import PYTHON, REPO, Engine, python_mounts

MIB = 1024 * 1024


def job(image: str, **container: object) -> LaunchArgs:
    """A one-rank launch of a job whose ranks run in `image`."""
    spec = ContainerSpec.model_validate({"image": image, "mounts": python_mounts(), **container})
    return LaunchArgs(
        restart_epoch=2, world_size=1, master_addr="127.0.0.1", master_port=29500, command=[PYTHON],
        ranks=[RankAssignment(rank=0, node_id="n1", local_rank=0)], container=spec,
    )  # fmt: skip


def engine_for(engine: Engine, tmp_path: Path, *, images: frozenset[str] | None = None) -> ContainerEngine:
    roots = (Path(os.path.realpath(sys.base_prefix)), REPO, tmp_path)
    policy = ContainerPolicy(mount_roots=roots, images=images)
    return ContainerEngine(base_url=engine.url, policy=policy, inbox_dir=tmp_path / "inbox")


ENV = {"REPRISE_JOB_ID": "job-1", "REPRISE_NODE_ID": "n1", "REPRISE_RESTART_EPOCH": "2", "RANK": "0"}


async def start(
    engine: Engine, tmp_path: Path, code: str, *, env: dict[str, str] | None = None, **container: object
) -> ContainerHandle:
    launcher = engine_for(engine, tmp_path).for_job(job(engine.image, **container))
    return await launcher.start([PYTHON, "-c", code], env={**ENV, **(env or {})}, cwd=str(REPO), warm=True)


async def test_a_rank_in_a_container_gets_its_env_and_labels_and_its_exit_code(
    docker_engine: Engine, tmp_path: Path
) -> None:
    code = "import os, sys, torch, reprise_sdk; print(os.environ['RANK'], os.environ['WHO'], os.getcwd()); sys.exit(3)"
    handle = await start(docker_engine, tmp_path, code, env={"WHO": "me"})
    labels = handle.container.labels
    assert (
        labels["io.reprise.job"] == "job-1" and labels["io.reprise.epoch"] == "2" and labels["io.reprise.rank"] == "0"
    )
    assert handle.pid != handle.init_pid and not handle.warm  # the rank's process, under the container's init
    out = (await asyncio.wait_for(handle.output.read(), 60)).decode().split()
    assert out == ["0", "me", str(REPO)]
    assert await asyncio.wait_for(handle.wait(), 30) == 3 and handle.returncode == 3
    assert not handle.oom_killed()
    client = docker.DockerClient(base_url=docker_engine.url)
    ours = {"id": handle.container.id}
    assert await poll_until(lambda: not client.containers.list(all=True, sparse=True, filters=ours), timeout_s=30)


async def test_a_clean_exit_is_0(docker_engine: Engine, tmp_path: Path) -> None:
    handle = await start(docker_engine, tmp_path, "print('done')")
    assert await asyncio.wait_for(handle.wait(), 30) == 0


async def test_a_sigkilled_rank_is_minus_9_from_the_host_or_through_its_handle(
    docker_engine: Engine, tmp_path: Path
) -> None:
    for kill in (lambda h: os.kill(h.pid, signal.SIGKILL), lambda h: h.kill()):
        handle = await start(docker_engine, tmp_path, "import time; print('up', flush=True); time.sleep(60)")
        assert await asyncio.wait_for(handle.output.readline(), 30) == b"up\n"
        kill(handle)
        assert await asyncio.wait_for(handle.wait(), 30) == -signal.SIGKILL  # the container's 137
        assert not handle.oom_killed()


async def test_a_frozen_rank_freezes_and_stops_on_terminate(docker_engine: Engine, tmp_path: Path) -> None:
    handle = await start(docker_engine, tmp_path, "import time; print('up', flush=True); time.sleep(60)")
    assert await asyncio.wait_for(handle.output.readline(), 30) == b"up\n"
    handle.signal(signal.SIGSTOP)
    assert await poll_until(lambda: (handle.usage() or ProcessSample("", 0)).state == "T", timeout_s=10)
    assert (handle.io_bytes() or 0) > 0 and handle.record()["container_id"] == handle.container.id
    handle.terminate()
    assert await asyncio.wait_for(handle.wait(), 30) == -signal.SIGTERM
    assert handle.usage() is None


async def test_the_containers_oom_kill_is_its_own_cause(docker_engine: Engine, tmp_path: Path) -> None:
    code = "print('up', flush=True); block = bytearray(400 * 1024 * 1024); print('survived')"
    handle = await start(docker_engine, tmp_path, code, memory_bytes=128 * MIB, pids_limit=64, cpus=1.0)
    assert await asyncio.wait_for(handle.wait(), 60) == -signal.SIGKILL
    assert handle.oom_killed()
    assert b"survived" not in await handle.output.read()


async def test_a_missing_image_is_a_clear_non_retryable_error(docker_engine: Engine, tmp_path: Path) -> None:
    with pytest.raises(LaunchRefusedError, match=r"container\.image .reprise/nothing:here. is not on this node") as err:
        engine_for(docker_engine, tmp_path).for_job(job("reprise/nothing:here"))
    assert not err.value.retryable


async def test_an_image_the_daemon_had_is_not_asked_for_again_and_one_removed_meanwhile_fails_clearly(
    docker_engine: Engine, tmp_path: Path
) -> None:
    """The look for the image took a daemon round trip, on the agent's loop, at every launch: also a recovery's that
    restarts every rank in place or on a standby, which needs no daemon."""
    client = docker.DockerClient(base_url=docker_engine.url)
    client.images.get(docker_engine.image).tag("reprise-test/seen", "1")
    engine = engine_for(docker_engine, tmp_path)
    engine.for_job(job("reprise-test/seen:1"))
    client.images.remove("reprise-test/seen:1")  # the tag only: the test image stays
    live_url = engine.base_url
    engine.base_url, engine._client = f"unix://{tmp_path / 'no-daemon.sock'}", None
    launcher = engine.for_job(job("reprise-test/seen:1"))  # no call to the daemon: none answers here
    engine.base_url, engine._client = live_url, None
    with pytest.raises(LaunchRefusedError, match=r"container\.image .reprise-test/seen:1. is not on this node"):
        await launcher.start([PYTHON, "-c", "pass"], env=ENV, cwd=None, warm=False)
    with pytest.raises(LaunchRefusedError, match="is not on this node"):  # forgotten: asked again, and refused
        engine.for_job(job("reprise-test/seen:1"))


async def test_a_refused_create_is_a_clear_non_retryable_error(docker_engine: Engine, tmp_path: Path) -> None:
    launcher = engine_for(docker_engine, tmp_path).for_job(job(docker_engine.image, user="no-such-user"))
    with pytest.raises(LaunchRefusedError, match="refused") as err:
        await launcher.start([PYTHON, "-c", "pass"], env=ENV, cwd=None, warm=False)
    assert not err.value.retryable


async def test_the_nodes_roots_and_image_allow_list_refuse_a_spec_naming_the_field(
    docker_engine: Engine, tmp_path: Path
) -> None:
    spec = job(docker_engine.image, mounts=[*python_mounts(), {"source": "/etc", "target": "/host-etc"}])
    with pytest.raises(LaunchRefusedError, match=r"container.mounts\[2\].source refused: /etc is outside"):
        engine_for(docker_engine, tmp_path).for_job(spec)
    link = tmp_path / "sneaky"
    link.symlink_to("/var/run")
    spec = job(docker_engine.image, mounts=[{"source": str(link), "target": "/x"}])
    with pytest.raises(LaunchRefusedError, match=r"container.mounts\[0\].source refused: .*Docker socket"):
        engine_for(docker_engine, tmp_path).for_job(spec)
    with pytest.raises(LaunchRefusedError, match=r"container\.image refused: .* is not on the node.s image allow-list"):
        engine_for(docker_engine, tmp_path, images=frozenset({"team/train:1"})).for_job(job(docker_engine.image))


async def test_the_stacks_of_a_hung_containerized_rank_are_read_from_the_host(
    docker_engine: Engine, tmp_path: Path
) -> None:
    py_spy = find_py_spy()
    if py_spy is None:
        pytest.skip("py-spy is not installed")
    code = "import time\ndef stuck_in_here():\n    print('up', flush=True); time.sleep(60)\nstuck_in_here()\n"
    handle = await start(docker_engine, tmp_path, code)
    assert await asyncio.wait_for(handle.output.readline(), 30) == b"up\n"
    found = (await capture([handle], py_spy=py_spy, within_s=10.0))[handle.pid]
    assert not found.error, found.error
    assert "stuck_in_here" in top_frame(found.threads) or any(
        "stuck_in_here" in str(thread) for thread in found.threads
    )
    handle.kill()
    assert await asyncio.wait_for(handle.wait(), 30) == -signal.SIGKILL


async def test_a_rank_quiet_for_longer_than_the_clients_timeout_keeps_its_output(
    docker_engine: Engine, tmp_path: Path
) -> None:
    engine = engine_for(docker_engine, tmp_path)
    engine.timeout_s = 1.0  # the daemon's calls time out after 1 s; the output stream must not
    code = "import time; print('a', flush=True); time.sleep(3); print('b', flush=True)"
    handle = await engine.for_job(job(docker_engine.image)).start([PYTHON, "-c", code], env=ENV, cwd=None, warm=False)
    assert await asyncio.wait_for(handle.wait(), 30) == 0
    assert (await handle.output.read()).split() == [b"a", b"b"]


async def test_a_daemon_that_does_not_answer_is_a_retryable_dependency_fault(
    docker_engine: Engine, tmp_path: Path
) -> None:
    down = engine_for(docker_engine, tmp_path)
    down.base_url = f"unix://{tmp_path / 'no-daemon.sock'}"
    with pytest.raises(DockerUnavailableError, match="did not answer") as err:
        down.for_job(job(docker_engine.image))
    assert err.value.retryable and err.value.dependency == "the Docker daemon"


SHELL_RANK = "echo out; echo err >&2; exit 3"


@pytest.mark.parametrize(
    ("argv", "in_file"),
    [
        (["bash", "-c", SHELL_RANK], True),
        (["sh", "-c", SHELL_RANK], True),
        (["/bin/sh", "-c", SHELL_RANK], True),
        (["env", "sh", "-c", "echo out; exit 3"], False),  # the shell is not the command: the daemon's log
    ],
)
async def test_a_shell_ranks_output_comes_from_its_file_and_another_commands_from_the_daemon(
    docker_engine: Engine, tmp_path: Path, argv: list[str], in_file: bool
) -> None:
    launcher = engine_for(docker_engine, tmp_path).for_job(job(docker_engine.image))
    env = {**ENV, "REPRISE_SDK_INBOX_DIR": "/run/reprise-inbox"}
    handle = await launcher.start(argv, env=env, cwd=None, warm=False)
    assert (handle.output_file is not None) is in_file
    output = (await asyncio.wait_for(handle.output.read(), 30)).decode()
    assert output == ("out\nerr\n" if in_file else "out\n")  # its own, in order, and nothing of the redirect
    assert await asyncio.wait_for(handle.wait(), 30) == 3
