"""The platform's Redis on a real server: the ACL admits only the Reprise user, and its password is on no command
line and in no file of the server, where another local user could read it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from reprise_cli.redis_server import REDIS_ACL_FILE, REDIS_USER, RedisServer
from reprise_cli.servers import free_port

PASSWORD = "pw-" + "q7" * 20


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A running Redis with the platform's ACL; stopped after the test."""
    started = RedisServer(
        port=free_port(), data_dir=tmp_path / "redis", log_path=tmp_path / "redis.log", password=PASSWORD
    )
    started.start()
    yield started
    started.stop()


def test_the_password_is_on_no_command_line_and_in_no_file_of_the_server(server: RedisServer) -> None:
    assert server.process is not None and "--aclfile" in server.process.argv
    # redis-server rewrites its process title once it runs, but until then ps shows every argument to any local user
    assert not [arg for arg in server.process.argv if PASSWORD in arg], "the Redis password is on the command line"
    stored = [path for path in server.data_dir.rglob("*") if path.is_file() and PASSWORD.encode() in path.read_bytes()]
    assert not stored, f"the Redis password is stored in {stored}"
    assert (server.data_dir / REDIS_ACL_FILE).stat().st_mode & 0o077 == 0


def test_a_relative_data_dir_works_as_the_demo_gives_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the server runs in its data dir: a relative ACL path would point elsewhere
    started = RedisServer(
        port=free_port(), data_dir=Path(".state/redis"), log_path=Path(".state/redis.log"), password=PASSWORD
    )
    started.start()
    try:
        client = redis.Redis(port=started.port, username=REDIS_USER, password=PASSWORD, socket_timeout=2)
        assert client.ping()
        client.close()
    finally:
        started.stop()


def test_only_the_reprise_user_reaches_only_reprise_keys(server: RedisServer) -> None:
    client = redis.Redis(port=server.port, username=REDIS_USER, password=PASSWORD, socket_timeout=2)
    try:
        assert client.set("reprise:acl", "1") and client.get("reprise:acl") == b"1"
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.set("other:acl", "1")
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.flushall()
    finally:
        client.close()
    for username, password in ((None, None), (REDIS_USER, PASSWORD + "x")):
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port, username=username, password=password, socket_timeout=2).ping()
