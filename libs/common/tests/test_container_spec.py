"""The container spec's safety rules that need no settings: each refusal names the field, on the wire as in code."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from reprise_common.events import ContainerSpec, LaunchCommand, parse_command

IMAGE = "team/train:1"


@pytest.mark.parametrize(
    ("spec", "field", "why"),
    [
        ({"privileged": True}, "privileged", "privileged containers are refused"),
        ({"pid_mode": "host"}, "pid_mode", "pid_mode 'host' is refused"),
        ({"cap_add": ["SYS_ADMIN", "IPC_LOCK"]}, "cap_add", "cap_add refused: SYS_ADMIN"),
        ({"cap_add": ["CAP_NET_ADMIN"]}, "cap_add", "cap_add refused: NET_ADMIN"),
        ({"mounts": [{"source": "/var/run/docker.sock", "target": "/s"}]}, "mounts.0.source", "Docker socket"),
        ({"mounts": [{"source": "/run/../var/run", "target": "/s"}]}, "mounts.0.source", "holds the Docker socket"),
        ({"mounts": [{"source": "/srv/x/docker.sock", "target": "/s"}]}, "mounts.0.source", "is a Docker socket"),
        ({"mounts": [{"source": "//", "target": "/h"}]}, "mounts.0.source", "the host's root file system"),
        ({"mounts": [{"source": "data", "target": "/d"}]}, "mounts.0.source", "not an absolute path"),
        ({"mounts": [{"source": "/data", "target": "d"}]}, "mounts.0.target", "not an absolute path"),
        ({"memory_bytes": 1024}, "memory_bytes", "greater than or equal"),
    ],
)
def test_an_unsafe_spec_is_refused_naming_the_field(spec: dict[str, object], field: str, why: str) -> None:
    with pytest.raises(ValidationError) as err:
        ContainerSpec.model_validate({"image": IMAGE, **spec})
    (error,) = err.value.errors()
    assert ".".join(map(str, error["loc"])) == field
    assert why in error["msg"]


def test_a_safe_spec_is_kept_and_rides_a_launch_command() -> None:
    spec = ContainerSpec(
        image=IMAGE,
        mounts=[{"source": "/data/ckpt/./run1", "target": "/ckpt"}],  # type: ignore[list-item]
        cap_add=["CAP_IPC_LOCK", "SYS_PTRACE"],
        memory_bytes=2**30,
        cpus=2.5,
    )
    assert spec.mounts[0].source == "/data/ckpt/run1" and spec.mounts[0].read_only
    assert spec.cap_add == ["IPC_LOCK", "SYS_PTRACE"] and not spec.privileged and spec.pid_mode is None
    command = {
        "action": "launch", "command_id": "c1", "job_id": "j1", "fence": 1,
        "args": {
            "restart_epoch": 0, "world_size": 1, "master_addr": "127.0.0.1", "master_port": 29500,
            "command": ["python", "train.py"], "ranks": [{"rank": 0, "node_id": "n1", "local_rank": 0}],
            "container": spec.model_dump(mode="json"),
        },
    }  # fmt: skip
    parsed = parse_command(LaunchCommand.model_validate(command).model_dump_json().encode())
    assert isinstance(parsed, LaunchCommand) and parsed.args.container == spec


def test_a_launch_without_a_container_runs_processes() -> None:
    command = {
        "action": "launch", "command_id": "c1", "job_id": "j1", "fence": 1,
        "args": {
            "restart_epoch": 0, "world_size": 1, "master_addr": "127.0.0.1", "master_port": 29500,
            "command": ["python"], "ranks": [{"rank": 0, "node_id": "n1", "local_rank": 0}],
        },
    }  # fmt: skip
    parsed = LaunchCommand.model_validate(command)
    assert parsed.args.container is None
