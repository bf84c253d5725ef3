"""A real kube-apiserver for the tests: built once from Debian's source package and cached on the machine.

Bookworm's source package `kubernetes` (1.20.5+really1.20.2) is the complete v1.20.2 tree with its `vendor/`
directory, so it builds offline (`GOPROXY=off`) with Debian's Go. Two snags: the vendored `reflect2` v1.0.1 crashes on
Go >= 1.18 (Debian's 1.0.2 replaces it), and `pkg/generated/openapi` is missing (the tree's `make` generates it).
Everything lives under a machine-wide cache directory, never in the repository: the private apt lists, the source
tree with its Go build cache, and the binary, keyed by version so a rebuild never happens on every run. A file lock
keeps two test processes from building at once. Packages are installed with `--no-upgrade` from a private sources
list, so the system's own lists and installed versions are left as they are.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO
from urllib.parse import urlparse

from reprise_common.errors import ConfigError

KUBE_VERSION = "1.20.2"
SOURCE_PACKAGE = "kubernetes"
GO_VERSION = "1.23"
BUILD_PACKAGES = (
    f"golang-{GO_VERSION}-go",
    "make",
    "rsync",
    "jq",
    "dpkg-dev",
    "golang-github-modern-go-reflect2-dev",
    "etcd-server",
    "openssl",
)
REFLECT2_SOURCE = Path("/usr/share/gocode/src/github.com/modern-go/reflect2")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
_SYSTEM_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
_BUILD_TIMEOUT_S = 3600.0


def cache_root() -> Path:
    """The machine-wide cache (REPRISE_KUBE_CACHE overrides /var/cache/reprise)."""
    return Path(os.environ.get("REPRISE_KUBE_CACHE", "/var/cache/reprise"))


def apiserver_dir(version: str = KUBE_VERSION) -> Path:
    """Where one version's binary and build log are kept."""
    return cache_root() / f"kube-apiserver-{version}"


def apiserver_path(version: str = KUBE_VERSION) -> Path:
    """The cached binary's path (it may not exist yet)."""
    return apiserver_dir(version) / "kube-apiserver"


def debian_mirror() -> str:
    """The machine's Debian mirror, as its own sources name it (deb.debian.org when they say nothing)."""
    try:
        text = _SYSTEM_SOURCES.read_text()
    except OSError:
        return DEFAULT_MIRROR
    for line in text.splitlines():
        if line.startswith("URIs:"):
            uri = line.split(":", 1)[1].strip().split()[0]
            if uri.rstrip("/").endswith("/debian"):
                return uri.rstrip("/")
    return DEFAULT_MIRROR


def build_unavailable_reason() -> str | None:
    """Why the API server can neither be found in the cache nor built here, or None when it can."""
    if apiserver_path().is_file() and shutil.which("etcd"):
        return None
    if os.geteuid() != 0:
        return "building kube-apiserver needs root (apt-get install of Debian's Go, etcd-server and the source)"
    if shutil.which("apt-get") is None:
        return "building kube-apiserver needs apt-get (a Debian machine)"
    host = urlparse(debian_mirror()).hostname or "deb.debian.org"
    try:
        socket.create_connection((host, 80), timeout=5).close()
    except OSError as exc:
        return f"building kube-apiserver needs the Debian mirror {host}, unreachable: {exc}"
    return None


@contextmanager
def _build_lock() -> Iterator[None]:
    """An exclusive lock on the cache, held while one process checks and builds."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"kube-apiserver-{KUBE_VERSION}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_apiserver() -> Path:
    """The cached kube-apiserver binary, built from Debian's source package the first time (5-11 minutes)."""
    target = apiserver_path()
    if target.is_file() and shutil.which("etcd"):
        return target
    with _build_lock():
        if target.is_file() and shutil.which("etcd"):
            return target
        reason = build_unavailable_reason()
        if reason is not None:
            raise ConfigError(reason)
        target.parent.mkdir(parents=True, exist_ok=True)
        log = target.parent / "build.log"
        with open(log, "a") as out:
            started = time.monotonic()
            _install_packages(out)
            tree = _unpack_source(out)
            built = _make_apiserver(tree, out)
            elapsed = time.monotonic() - started
            out.write(f"built {built} in {elapsed:.0f} s\n")
        staged = target.with_suffix(".partial")
        shutil.copy2(built, staged)
        staged.replace(target)
    return target


def _apt_dir() -> Path:
    return cache_root() / "apt"


def _write_sources() -> Path:
    """A private sources list: bookworm, its updates, security and backports, and bookworm's sources."""
    mirror = debian_mirror()
    security = mirror.rsplit("/", 1)[0] + "/debian-security"
    lines = [
        f"deb {mirror} bookworm main",
        f"deb {mirror} bookworm-updates main",
        f"deb {security} bookworm-security main",
        f"deb {mirror} bookworm-backports main",
        f"deb-src {mirror} bookworm main",
    ]
    path = _apt_dir() / "sources.list"
    (_apt_dir() / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def _apt(args: list[str], out: IO[str], cwd: Path | None = None) -> None:
    """apt-get with the private sources and lists: the system's own lists stay untouched."""
    sources = _write_sources()
    options = [
        "-o",
        f"Dir::Etc::SourceList={sources}",
        "-o",
        "Dir::Etc::SourceParts=/dev/null",
        "-o",
        f"Dir::State::Lists={_apt_dir() / 'lists'}",
    ]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", *options, *args], out, cwd=cwd, env=env)


def _run(argv: list[str], out: IO[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    """Run one build step, its output appended to the build log; a failure names the step and the log."""
    out.write(f"$ {' '.join(argv)}\n")
    out.flush()
    result = subprocess.run(
        argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=_BUILD_TIMEOUT_S, check=False
    )
    if result.returncode != 0:
        log = getattr(out, "name", "the build log")
        raise ConfigError(
            f"building kube-apiserver failed at `{' '.join(argv[:3])} ...` (exit {result.returncode}); see {log}"
        )


def _install_packages(out: IO[str]) -> None:
    """Debian's Go (from backports), etcd, openssl and the build tools, upgrading nothing already installed."""
    _apt(["update"], out)
    _apt(["install", "-y", "--no-install-recommends", "--no-upgrade", *BUILD_PACKAGES], out)


def _source_dir() -> Path:
    return cache_root() / "src"


def _unpack_source(out: IO[str]) -> Path:
    """Debian's kubernetes source tree, unpacked once, with the vendored reflect2 replaced by Debian's 1.0.2."""
    tree = _source_dir() / f"kubernetes-{KUBE_VERSION}"
    if not (tree / "Makefile").is_file():
        _source_dir().mkdir(parents=True, exist_ok=True)
        _apt(["source", "--download-only", SOURCE_PACKAGE], out, cwd=_source_dir())
        dsc = sorted(_source_dir().glob(f"{SOURCE_PACKAGE}_*.dsc"))
        if not dsc:
            raise ConfigError(f"apt-get source fetched no {SOURCE_PACKAGE} .dsc into {_source_dir()}")
        shutil.rmtree(tree, ignore_errors=True)
        _run(["dpkg-source", "--no-check", "-x", str(dsc[-1]), str(tree)], out)
    vendored = tree / "vendor" / "github.com" / "modern-go" / "reflect2"
    shutil.rmtree(vendored, ignore_errors=True)
    shutil.copytree(REFLECT2_SOURCE, vendored)
    return tree


def _make_apiserver(tree: Path, out: IO[str]) -> Path:
    """`make WHAT=cmd/kube-apiserver` offline in GOPATH mode (the tree's scripts set it, and put Go's build cache in
    the tree's `_output/`, under our cache too)."""
    env = {
        **os.environ,
        "PATH": f"/usr/lib/go-{GO_VERSION}/bin:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "GOPROXY": "off",
        "GOTOOLCHAIN": "local",
    }
    env.pop("GOFLAGS", None)
    _run(["make", "WHAT=cmd/kube-apiserver"], out, cwd=tree, env=env)
    for candidate in (tree / "_output" / "bin" / "kube-apiserver", tree / "_output" / "local" / "bin"):
        if candidate.is_file():
            return candidate
    found = sorted((tree / "_output").rglob("kube-apiserver"))
    binaries = [path for path in found if path.is_file() and os.access(path, os.X_OK)]
    if not binaries:
        raise ConfigError(f"make finished but no kube-apiserver binary under {tree / '_output'}")
    return binaries[0]


def main() -> int:
    """`python -m reprise_cli.kube`: build and cache kube-apiserver where it can be (make kube-deps); never fails
    where it cannot, saying why (the tests on the real API server are then skipped with the same reason)."""
    reason = build_unavailable_reason()
    if reason is not None:
        print(f"kube-deps: {reason}: the tests on a real Kubernetes API server will be skipped")
        return 0
    if not apiserver_path().is_file():
        print(f"kube-deps: building kube-apiserver {KUBE_VERSION} from Debian's source package (5-11 minutes, once)")
    started = time.monotonic()
    path = ensure_apiserver()
    print(f"kube-deps: {path} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
