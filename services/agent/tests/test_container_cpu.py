"""Where a container's CPU weight lives, read from /proc as a host with cgroup v1, v2 or both shows it (the real
dockerd's v1 case is tests/containers/test_container_standby.py)."""

from __future__ import annotations

from pathlib import Path

from reprise_agent.launch.container_cpu import cpu_files, parse_mounts

V2 = "35 25 0:30 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
V1 = (
    "30 25 0:26 / /sys/fs/cgroup/cpu,cpuacct rw shared:10 - cgroup cgroup rw,cpu,cpuacct\n"
    "31 25 0:27 / /sys/fs/cgroup/memory rw shared:11 - cgroup cgroup rw,memory\n"
    "29 25 0:25 / /sys/fs/cgroup/unified rw shared:8 - cgroup2 cgroup2 rw,nsdelegate\n"
    "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
)


def test_a_v2_container_s_weight_is_its_cgroup_s_cpu_weight() -> None:
    cgroup = "0::/system.slice/docker-abc.scope\n"
    assert cpu_files(cgroup, parse_mounts(V2)) == [Path("/sys/fs/cgroup/system.slice/docker-abc.scope/cpu.weight")]


def test_on_a_hybrid_host_the_v1_cpu_hierarchy_comes_first() -> None:
    cgroup = "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/docker/abc\n"
    assert cpu_files(cgroup, parse_mounts(V1)) == [
        Path("/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.shares"),
        Path("/sys/fs/cgroup/unified/docker/abc/cpu.weight"),
    ]


def test_a_mount_of_a_sub_tree_is_followed_and_one_elsewhere_left_out() -> None:
    nested = "40 25 0:30 /kubepods /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    assert cpu_files("0::/kubepods/pod1/abc\n", parse_mounts(nested)) == [Path("/sys/fs/cgroup/pod1/abc/cpu.weight")]
    assert cpu_files("0::/other/abc\n", parse_mounts(nested)) == []
