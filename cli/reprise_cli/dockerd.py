"""A Docker Engine of our own for the container launcher's tests and the local stack: Debian's docker.io installed
with apt-get when dockerd is missing (as root), a dockerd started with its socket, data and exec roots under a
directory we choose, and the ranks' base image built from Debian's packages (debootstrap, `docker import`), cached on
this machine by its recipe's hash: nothing is ever pulled from a registry.

The daemon runs without a bridge and without iptables rules (ranks use host networking), so that several of these
daemons, other workers' included, can run side by side on one machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from reprise_cli.servers import ManagedProcess
from reprise_common.errors import ConfigError
from reprise_common.procs import process_alive

INSTALL_HINT = "run as root on Debian (apt-get install docker.io debootstrap)"
BASE_SUITE = "bookworm"
BASE_REPOSITORY = "reprise/base"
# What a rank needs of the image when it runs the host's interpreter and virtualenv mounted read-only
# (docs/containers.md): the shared libraries CPython and torch link against (minbase has libc, libstdc++, little else).
BASE_PACKAGES = (
    "ca-certificates", "libbz2-1.0", "libffi8", "libgomp1", "liblzma5", "libncursesw6", "libreadline8",
    "libsqlite3-0", "libssl3", "procps", "zlib1g",
)  # fmt: skip
DEFAULT_MIRROR = "http://deb.debian.org/debian"
SOCKET_PATH_MAX = 104  # containerd's limit for a Unix socket's path


def _find(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for d in ("/usr/sbin", "/usr/bin", "/sbin") if (p := Path(d) / name).exists()), None
    )


def docker_unavailable_reason() -> str | None:
    """Why no dockerd can run here (None: it can): not installed, and not installable by us."""
    if _find("dockerd") and _find("debootstrap"):
        return None
    if os.geteuid() != 0:
        return f"dockerd or debootstrap is not installed and this is not root: {INSTALL_HINT}"
    if shutil.which("apt-get") is None:
        return f"dockerd or debootstrap is not installed and there is no apt-get: {INSTALL_HINT}"
    return None


def install_docker(timeout_s: float = 900.0) -> None:
    """Install docker.io and debootstrap with apt-get when dockerd or debootstrap is missing; raises ConfigError with
    the reason when it cannot."""
    reason = docker_unavailable_reason()
    if reason is not None:
        raise ConfigError(reason)
    if _find("dockerd") and _find("debootstrap"):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "docker.io", "debootstrap"],
    ):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise ConfigError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    if not _find("dockerd"):
        raise ConfigError(f"apt-get installed docker.io but dockerd is not on PATH: {INSTALL_HINT}")


@dataclass
class DockerDaemon:
    """A dockerd of our own: its socket, data root, exec root and log under `directory`."""

    directory: Path
    data_root: Path | None = None  # default: <directory>/data
    live_restore: bool = False  # containers keep running while the daemon is down, and it takes them up again
    process: ManagedProcess | None = None

    @property
    def socket(self) -> Path:
        """Its API socket."""
        return self.directory / "docker.sock"

    @property
    def url(self) -> str:
        """The base URL the docker SDK connects to."""
        return f"unix://{self.socket}"

    @property
    def exec_root(self) -> Path:
        """Its exec root: ``<directory>/exec``, or a short one in the temp directory when containerd's sockets there
        would pass the 104-byte limit of a socket path."""
        path = self.directory.absolute() / "exec"
        if len(os.fsencode(path / "containerd" / "containerd-debug.sock")) <= SOCKET_PATH_MAX:
            return path
        digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"reprise-dockerd-{digest}"

    def start(self, timeout_s: float = 60.0) -> None:
        """Install Docker where needed, start the daemon and wait until it answers a ping."""
        install_docker()
        dockerd = _find("dockerd")
        assert dockerd is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        self._forget_dead_pids()
        data_root = self.data_root or self.directory / "data"
        argv = [
            dockerd,
            "--host", self.url,
            "--data-root", str(data_root),
            "--exec-root", str(self.exec_root),
            "--pidfile", str(self.directory / "dockerd.pid"),
            "--storage-driver", "overlay2",
            "--bridge", "none",  # ranks use host networking; no docker0 to fight over with other daemons
            "--iptables=false",
            "--ip-masq=false",
            *(["--live-restore"] if self.live_restore else []),
        ]  # fmt: skip
        self.process = ManagedProcess("dockerd", argv, self.directory / "dockerd.log")
        self.process.start()
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if not self.process.alive():
                raise ConfigError(f"dockerd exited ({self.process.crashed()}): {self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise ConfigError(f"dockerd did not answer within {timeout_s} s: {self.log_tail()}")
            time.sleep(0.2)

    def _forget_dead_pids(self) -> None:
        """Remove the pid files of a daemon that was killed: its containerd may linger as a zombie where nothing
        reaps orphans (pid 1 of some sandboxes), and a new dockerd would wait for it until it gives up."""
        for pidfile in (self.directory / "dockerd.pid", self.exec_root / "containerd" / "containerd.pid"):
            try:
                pid = int(pidfile.read_text().strip())
            except (OSError, ValueError):
                continue
            if not process_alive(pid):
                pidfile.unlink(missing_ok=True)

    def ready(self) -> bool:
        """The daemon answers a ping on its socket."""
        import docker  # noqa: PLC0415 - the SDK only where a daemon is used

        if self.process is None or not self.process.alive() or not self.socket.exists():
            return False
        try:
            client = docker.DockerClient(base_url=self.url, timeout=5)
        except docker.errors.DockerException:
            return False
        try:
            return bool(client.ping())
        except docker.errors.DockerException:
            return False
        finally:
            client.close()

    def log_tail(self, lines: int = 15) -> str:
        """The end of its log."""
        try:
            return " | ".join(self.process_log().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def process_log(self) -> str:
        """Its whole log."""
        return (self.directory / "dockerd.log").read_text(encoding="utf-8", errors="replace")

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop it (its containers die with it: none of them is set to restart), and detach what it left mounted
        under its directory (network namespaces, overlays of a daemon that was killed), so the directory can go."""
        if self.process is not None:
            self.process.stop(grace_s=grace_s)
        for mount_point in [*mounts_under(self.directory), *mounts_under(self.exec_root)]:
            subprocess.run(["umount", "-l", mount_point], capture_output=True, timeout=30, check=False)
        if not self.exec_root.is_relative_to(self.directory.absolute()):
            shutil.rmtree(self.exec_root, ignore_errors=True)


def mounts_under(directory: Path) -> list[str]:
    """The mount points at or below `directory`, deepest first."""
    root = os.path.realpath(directory)
    try:
        lines = Path("/proc/self/mountinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    points = [line.split()[4].replace("\\040", " ") for line in lines if len(line.split()) > 4]
    return sorted((p for p in points if p == root or p.startswith(root + "/")), key=len, reverse=True)


def cache_dir() -> Path:
    """Where built root file systems are kept between runs: $REPRISE_CACHE_DIR, else ~/.cache/reprise."""
    override = os.environ.get("REPRISE_CACHE_DIR")
    return Path(override) if override else Path.home() / ".cache" / "reprise"


def package_recipe(packages: tuple[str, ...], mirror: str) -> str:
    """What debootstrap is asked for: a minimal Debian with `packages` (its hash names the cached root file system)."""
    return f"debootstrap --variant=minbase --include={','.join(packages)} {BASE_SUITE} {mirror}"


def base_recipe(mirror: str = DEFAULT_MIRROR) -> str:
    """The base image's recipe: what debootstrap is asked for (its hash names the cached root file system)."""
    return package_recipe(BASE_PACKAGES, mirror)


def base_image_tag(mirror: str = DEFAULT_MIRROR) -> str:
    """The base image's name: the repository and the recipe's hash."""
    digest = hashlib.sha256(base_recipe(mirror).encode()).hexdigest()[:12]
    return f"{BASE_REPOSITORY}:{BASE_SUITE}-{digest}"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (two test sessions must not build the same root file system at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def debootstrap_tar(recipe: str, tar: Path, *, mirror: str, timeout_s: float, exclude: tuple[str, ...] = ()) -> Path:
    """The root file system `recipe` makes, as the tar file `tar`: built once, kept until the recipe changes."""
    with file_lock(tar.with_suffix(".lock")):
        if tar.exists():
            return tar
        install_docker()
        debootstrap = _find("debootstrap")
        assert debootstrap is not None
        with tempfile.TemporaryDirectory(dir=tar.parent, prefix="rootfs-") as root:
            argv = [debootstrap, *recipe.split()[1:-2], BASE_SUITE, root, mirror]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
            if done.returncode != 0:
                raise ConfigError(f"debootstrap failed ({done.returncode}): {done.stdout.strip()[-500:]}")
            partial = tar.with_suffix(".partial")
            excluded = [f"--exclude={pattern}" for pattern in exclude]
            subprocess.run(["tar", "-C", root, *excluded, "-cf", str(partial), "."], check=True, timeout=timeout_s)
            partial.replace(tar)
    return tar


def base_rootfs_tar(*, mirror: str = DEFAULT_MIRROR, cache: Path | None = None, timeout_s: float = 900.0) -> Path:
    """The base image's root file system as a tar file, built with debootstrap once per recipe and kept in the cache."""
    tar = (cache or cache_dir()) / f"{base_image_tag(mirror).split(':', 1)[1]}.tar"
    return debootstrap_tar(base_recipe(mirror), tar, mirror=mirror, timeout_s=timeout_s)


def ensure_base_image(url: str, *, mirror: str = DEFAULT_MIRROR, cache: Path | None = None) -> str:
    """The base image in the daemon at `url`, imported from the cached root file system (built when missing)."""
    import docker  # noqa: PLC0415 - the SDK only where a daemon is used

    tag = base_image_tag(mirror)
    client = docker.DockerClient(base_url=url, timeout=300)
    try:
        with contextlib.suppress(docker.errors.ImageNotFound):
            client.images.get(tag)
            return tag
        tar = base_rootfs_tar(mirror=mirror, cache=cache)
        repository, version = tag.split(":", 1)
        client.api.import_image_from_file(str(tar), repository=repository, tag=version)
        client.images.get(tag)  # raises when the import did not take
        return tag
    finally:
        client.close()
