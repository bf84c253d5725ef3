"""docker-compose.yml runs the same stack as `reprise up` (cli/reprise_cli/topology.py); each failure names the drift.

The launcher's side comes from build_services() and DEFAULT_PORTS, the Docker side from the parsed compose file and
the Dockerfiles it builds, so changing either side alone fails here.
"""

from __future__ import annotations

import json
import shlex
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from reprise_cli.redis_server import REDIS_ACL_FILE, redis_acl
from reprise_cli.topology import DEFAULT_PORTS, ServiceSpec, StackConfig, build_services

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
INFRASTRUCTURE = ("nats", "redis", "postgres")
NATS_CLIENT_PORT = 4222  # nats-server's default; compose does not pass -p
REDIS_PORT = 6379  # redis-server's default; compose does not pass --port
NATS_CONF = ROOT / "deploy" / "creds" / "nats.conf"  # written by `reprise creds` from deploy/nats/nats.conf
CREDS_DIR = ROOT / "deploy" / "creds"
REDIS_CONF = ROOT / "deploy" / "redis" / "redis.conf"
# Launcher values that are host paths or host addresses; compose adapts them to containers (checked separately).
ADAPTED_ENV = {
    "REPRISE_NATS_URL",
    "REPRISE_REDIS_URL",
    "REPRISE_REGISTRY_URL",
    "REPRISE_DATABASE_URL",
    "REPRISE_HTTP_HOST",
    "REPRISE_STATE_DIR",
    "REPRISE_ADVERTISE_ADDR",
    "REPRISE_NATS_NKEY_SEED_FILE",
    "REPRISE_NODE_KEYS_FILE",  # the detector's: public keys only
    "REPRISE_NOTIFIER_SLACK_URL",  # the launcher's local Slack receiver; compose takes a real one from the shell
    "REPRISE_ORCHESTRATOR_URL",  # the dashboard's sources
    "REPRISE_DETECTOR_URL",
    "REPRISE_NOTIFIER_URL",
}
URL_ENV = ("REPRISE_NATS_URL", "REPRISE_REDIS_URL", "REPRISE_REGISTRY_URL", "REPRISE_DATABASE_URL")
URL_ENV += ("REPRISE_ORCHESTRATOR_URL", "REPRISE_DETECTOR_URL", "REPRISE_NOTIFIER_URL")
# Secrets: the launcher passes its own from the state dir; compose must take them from the shell, never hold one.
SECRET_ENV = {"REPRISE_ADMIN_API_KEY", "REPRISE_READ_API_KEY", "REPRISE_REDIS_PASSWORD"}
RESTART_POLICIES = {"unless-stopped", "always", "on-failure"}  # compose's default, "no", leaves a crash dead

LAUNCHER: list[ServiceSpec] = build_services(StackConfig(nodes=2, spares=1))


def _by_name(spec: ServiceSpec) -> str:
    return spec.name


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    """The services of docker-compose.yml, anchors and merge keys resolved."""
    document = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(document, dict) and isinstance(document.get("services"), dict), (
        f"{COMPOSE_FILE.name} has no services mapping"
    )
    found: dict[str, dict[str, Any]] = document["services"]
    return found


@pytest.fixture(scope="module")
def volumes() -> dict[str, Any]:
    """The named volumes docker-compose.yml declares."""
    declared: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text()).get("volumes") or {}
    return declared


# --- reading compose and Dockerfiles ------------------------------------------------------------------------------
def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command")
    if command is None:
        return []
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(key): "" if value is None else str(value) for key, value in env.items()}


def _published(service: dict[str, Any]) -> dict[int, int]:
    """Host port -> container port for each published port."""
    mapping: dict[int, int] = {}
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            mapping[int(entry["published"])] = int(entry["target"])
            continue
        parts = str(entry).split("/", 1)[0].split(":")
        assert len(parts) >= 2, f"port {entry!r} publishes no fixed host port"
        mapping[int(parts[-2])] = int(parts[-1])
    return mapping


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> source (a resolved host path for bind mounts, the name for named volumes)."""
    mounts: dict[str, str] = {}
    for entry in service.get("volumes") or []:
        if isinstance(entry, dict):
            source, target = str(entry["source"]), str(entry["target"])
        else:
            source, target = str(entry).split(":")[:2]
        is_path = source.startswith((".", "/"))
        mounts[target] = str((ROOT / source).resolve()) if is_path else source
    return mounts


def _credentials_mounted(mounts: dict[str, str]) -> dict[str, str]:
    """The mounts whose source is deploy/creds or lies in it: a container must see only its own identity."""
    return {target: source for target, source in mounts.items() if Path(source).is_relative_to(CREDS_DIR)}


def _dockerfile(service: dict[str, Any]) -> Path:
    build = service.get("build")
    assert build is not None, "no build section"
    if isinstance(build, str):
        return ROOT / build / "Dockerfile"
    return ROOT / str(build.get("context", ".")) / str(build.get("dockerfile", "Dockerfile"))


def _instructions(dockerfile: Path, keyword: str) -> list[str]:
    """The arguments of each instruction `keyword` (continuation lines joined)."""
    found: list[str] = []
    for line in dockerfile.read_text().replace("\\\n", " ").splitlines():
        word, _, rest = line.strip().partition(" ")
        if word.upper() == keyword:
            found.append(rest.strip())
    return found


def _dockerfile_cmd(dockerfile: Path) -> list[str]:
    cmds = _instructions(dockerfile, "CMD")
    assert cmds, f"{dockerfile.relative_to(ROOT)} has no CMD"
    last = cmds[-1]
    return list(json.loads(last)) if last.startswith("[") else ["/bin/sh", "-c", last]


def _script_owner(command: str) -> str:
    """The service directory whose pyproject.toml declares the console script `command`."""
    for pyproject in sorted((ROOT / "services").glob("*/pyproject.toml")):
        scripts = tomllib.loads(pyproject.read_text()).get("project", {}).get("scripts", {})
        if command in scripts:
            return pyproject.parent.relative_to(ROOT).as_posix()
    raise AssertionError(f"no services/*/pyproject.toml declares the console script {command!r}")


def _service(services: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    if name not in services:
        pytest.fail(f"docker-compose.yml has no service {name!r}")
    return services[name]


# --- the service set ----------------------------------------------------------------------------------------------
def test_compose_runs_the_launchers_services(services: dict[str, dict[str, Any]]) -> None:
    launcher = {spec.name for spec in LAUNCHER}
    compose = set(services) - set(INFRASTRUCTURE)
    assert compose == launcher, (
        f"in the launcher but not in docker-compose.yml: {sorted(launcher - compose)}; "
        f"in docker-compose.yml but not in the launcher: {sorted(compose - launcher)}"
    )
    missing = [name for name in INFRASTRUCTURE if name not in services]
    assert not missing, f"docker-compose.yml lacks infrastructure services {missing}"


# --- each launcher service ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", LAUNCHER, ids=_by_name)
def test_same_command(services: dict[str, dict[str, Any]], spec: ServiceSpec) -> None:
    compose = _command(_service(services, spec.name))
    assert compose == shlex.split(spec.command), (
        f"{spec.name}: docker-compose.yml runs {compose}, the launcher runs {spec.command!r} "
        f"(topology.ROLE_COMMANDS[{spec.role!r}])"
    )


@pytest.mark.parametrize("spec", LAUNCHER, ids=_by_name)
def test_same_env_names(services: dict[str, dict[str, Any]], spec: ServiceSpec) -> None:
    compose = {name for name in _env(_service(services, spec.name)) if name.startswith("REPRISE_")}
    launcher = set(spec.env)
    assert compose == launcher, (
        f"{spec.name}: set by the launcher but not by docker-compose.yml: {sorted(launcher - compose)}; "
        f"set by docker-compose.yml but not by the launcher: {sorted(compose - launcher)}"
    )


@pytest.mark.parametrize("spec", LAUNCHER, ids=_by_name)
def test_same_env_values_where_not_host_specific(services: dict[str, dict[str, Any]], spec: ServiceSpec) -> None:
    env = _env(_service(services, spec.name))
    drifted = {
        name: {"launcher": value, "compose": env.get(name)}
        for name, value in spec.env.items()
        if name not in ADAPTED_ENV | SECRET_ENV and env.get(name) != value
    }
    assert not drifted, f"{spec.name}: values differ: {drifted}"
    for name in SECRET_ENV & set(env):
        assert env[name].startswith(f"${{{name}:?"), (
            f"{spec.name}: {name} must come from the shell as ${{{name}:?message}} (required, never in the file), "
            f"not {env[name]!r}"
        )
    if "REPRISE_HTTP_HOST" in env:
        assert env["REPRISE_HTTP_HOST"] == "0.0.0.0", (
            f"{spec.name}: REPRISE_HTTP_HOST is {env['REPRISE_HTTP_HOST']!r}; in a container it must be 0.0.0.0 "
            "or the published port and the other containers cannot reach it"
        )
    if "REPRISE_STATE_DIR" in env:
        assert env["REPRISE_STATE_DIR"].startswith("/"), f"{spec.name}: REPRISE_STATE_DIR must be absolute"
    if "REPRISE_NATS_NKEY_SEED_FILE" in env:
        identity = Path(spec.env["REPRISE_NATS_NKEY_SEED_FILE"]).name
        mounts = _mounts(_service(services, spec.name))
        seed = Path(env["REPRISE_NATS_NKEY_SEED_FILE"])
        assert seed.name == identity, f"{spec.name}: uses NATS identity {seed.name}, the launcher {identity}"
        expected = {str(seed): str(CREDS_DIR / identity)}
        if "REPRISE_NODE_KEYS_FILE" in spec.env:  # the agents' public keys (no secret), where the launcher has them
            keys = Path(spec.env["REPRISE_NODE_KEYS_FILE"]).name
            expected[env.get("REPRISE_NODE_KEYS_FILE", "(not set)")] = str(CREDS_DIR / keys)
        assert _credentials_mounted(mounts) == expected, (
            f"{spec.name}: must mount {expected} of deploy/creds and nothing else of it ({mounts})"
        )
    if "REPRISE_ADVERTISE_ADDR" in env:
        assert env["REPRISE_ADVERTISE_ADDR"] == spec.name, (
            f"{spec.name}: REPRISE_ADVERTISE_ADDR must be the service's own name, the address other containers reach"
        )


@pytest.mark.parametrize("spec", LAUNCHER, ids=_by_name)
def test_urls_point_at_the_same_services(services: dict[str, dict[str, Any]], spec: ServiceSpec) -> None:
    """A launcher URL to host port P becomes a URL to the compose service publishing P, at its container port."""
    service = _service(services, spec.name)
    env = _env(service)
    publishers = {
        host: (name, target) for name, other in services.items() for host, target in _published(other).items()
    }
    depends_on = service.get("depends_on") or {}
    for name in URL_ENV:
        if name not in spec.env or name not in env:
            continue  # a missing name is reported by test_same_env_names
        launcher_url, compose_url = urlsplit(spec.env[name]), urlsplit(env[name])
        assert compose_url.hostname in services, (
            f"{spec.name}: {name}={env[name]} names host {compose_url.hostname!r}, which is not a compose service"
        )
        if launcher_url.port is not None:
            assert launcher_url.port in publishers, (
                f"{spec.name}: the launcher's {name}={spec.env[name]} uses port {launcher_url.port}, "
                "which no compose service publishes"
            )
            expected_host, expected_port = publishers[launcher_url.port]
            assert (compose_url.hostname, compose_url.port) == (expected_host, expected_port), (
                f"{spec.name}: {name}={env[name]} but the launcher's {spec.env[name]} is compose service "
                f"{expected_host!r} on container port {expected_port}"
            )
            assert compose_url.scheme == launcher_url.scheme, (
                f"{spec.name}: {name} scheme {compose_url.scheme!r} differs from the launcher's {launcher_url.scheme!r}"
            )
        condition = depends_on.get(compose_url.hostname) if isinstance(depends_on, dict) else None
        assert condition == {"condition": "service_healthy"}, (
            f"{spec.name}: uses {compose_url.hostname} ({name}) but depends_on has {condition!r} for it, "
            "not condition: service_healthy"
        )


@pytest.mark.parametrize("spec", LAUNCHER, ids=_by_name)
def test_same_published_port(services: dict[str, dict[str, Any]], spec: ServiceSpec) -> None:
    published = _published(_service(services, spec.name))
    assert published == {spec.http_port: spec.http_port}, (
        f"{spec.name}: docker-compose.yml publishes {published} (host: container), the launcher serves it on "
        f"{spec.http_port} (DEFAULT_PORTS[{spec.role!r}] = {DEFAULT_PORTS[spec.role]})"
    )


@pytest.mark.parametrize("spec", LAUNCHER, ids=_by_name)
def test_healthcheck_asks_readyz(services: dict[str, dict[str, Any]], spec: ServiceSpec) -> None:
    test = (_service(services, spec.name).get("healthcheck") or {}).get("test")
    probe = " ".join(test) if isinstance(test, list) else str(test)
    assert "/readyz" in probe, f"{spec.name}: healthcheck {test!r} does not ask /readyz"


@pytest.mark.parametrize("name", [*INFRASTRUCTURE, *(spec.name for spec in LAUNCHER)])
def test_every_container_is_restarted_when_it_crashes(services: dict[str, dict[str, Any]], name: str) -> None:
    """`reprise up` restarts a crashed server or service (cli/reprise_cli/supervise.py); compose must too."""
    policy = _service(services, name).get("restart")
    assert policy in RESTART_POLICIES, (
        f"{name}: restart is {policy!r}; a crashed container stays dead unless it is one of {sorted(RESTART_POLICIES)}"
    )


@pytest.mark.parametrize("spec", LAUNCHER, ids=_by_name)
def test_dockerfile_matches(services: dict[str, dict[str, Any]], spec: ServiceSpec) -> None:
    service = _service(services, spec.name)
    dockerfile = _dockerfile(service)
    assert dockerfile.is_file(), f"{spec.name}: builds {dockerfile.relative_to(ROOT)}, which does not exist"
    where = dockerfile.relative_to(ROOT)
    assert _dockerfile_cmd(dockerfile) == _command(service), (
        f"{spec.name}: {where} CMD {_dockerfile_cmd(dockerfile)} differs from the compose command {_command(service)}"
    )
    exposed = {int(port.split("/")[0]) for line in _instructions(dockerfile, "EXPOSE") for port in line.split()}
    assert DEFAULT_PORTS[spec.role] in exposed, (
        f"{spec.name}: {where} exposes {sorted(exposed)}, not DEFAULT_PORTS[{spec.role!r}] = {DEFAULT_PORTS[spec.role]}"
    )
    owner = _script_owner(spec.command)
    installs = " ".join(_instructions(dockerfile, "RUN"))
    assert f"./{owner}" in installs, f"{spec.name}: {where} does not install ./{owner}, which provides {spec.command}"
    users = _instructions(dockerfile, "USER")
    assert users and users[-1] not in {"root", "0"}, f"{spec.name}: {where} must end running as a non-root USER"


# --- infrastructure -----------------------------------------------------------------------------------------------
def test_nats_matches_the_launcher(services: dict[str, dict[str, Any]]) -> None:
    nats = _service(services, "nats")
    command = _command(nats)
    assert "-js" in command, f"nats runs {command} without -js (JetStream)"
    monitor = int(command[command.index("-m") + 1]) if "-m" in command else None
    published = _published(nats)
    expected = {DEFAULT_PORTS["nats"]: NATS_CLIENT_PORT, DEFAULT_PORTS["nats-monitor"]: monitor}
    assert published == expected, (
        f"nats publishes {published} (host: container), expected {expected} from DEFAULT_PORTS['nats'], "
        "DEFAULT_PORTS['nats-monitor'] and the -m port of its command"
    )
    config = next((command[i + 1] for i, arg in enumerate(command[:-1]) if arg in {"-c", "--config"}), None)
    mounts = _mounts(nats)
    assert config is not None and mounts.get(config) == str(NATS_CONF), (
        f"nats reads config {config!r}, but mounts {mounts}; it must mount deploy/creds/nats.conf there"
    )
    assert _credentials_mounted(mounts) == {config: str(NATS_CONF)}, (
        f"nats must mount deploy/creds/nats.conf and no seed file: {mounts}"
    )
    store = command[command.index("-sd") + 1] if "-sd" in command else None
    assert store in mounts, f"nats stores JetStream in {store!r}, which is not a mounted volume ({sorted(mounts)})"


def test_redis_matches_the_launcher(services: dict[str, dict[str, Any]]) -> None:
    redis = _service(services, "redis")
    published = _published(redis)
    assert published == {DEFAULT_PORTS["redis"]: REDIS_PORT}, (
        f"redis publishes {published} (host: container), expected {{{DEFAULT_PORTS['redis']}: {REDIS_PORT}}}"
    )
    wrapper = _command(redis)
    assert wrapper[:2] == ["sh", "-c"] and len(wrapper) == 3, f"redis must run one `sh -c` script, not {wrapper}"
    password = _env(_service(services, "orchestrator"))["REPRISE_REDIS_PASSWORD"]
    assert password not in wrapper[2] and "${REPRISE_REDIS_PASSWORD" not in wrapper[2], (
        "compose must not put the Redis password on redis's command line (any local user reads it)"
    )
    script = wrapper[2].replace("$$", "$")  # what the container's shell runs: compose unescapes $$
    assert _env(redis).get("REPRISE_REDIS_PASSWORD") == password, "redis must get the orchestrator's password"
    acl = redis_acl("%s").replace("\n", "\\n")  # the launcher's ACL file, as the printf template that writes it
    assert f"printf '{acl}'" in script, f"redis must write the launcher's ACL file {redis_acl('<sha256>')!r}"
    assert '"$(printf %s "$REPRISE_REDIS_PASSWORD" | sha256sum | cut -d \' \' -f 1)"' in script, (
        "the ACL file must hold the SHA-256 of the orchestrator's password"
    )
    command = shlex.split(script.rsplit("exec ", 1)[1])
    config = command[1] if len(command) > 1 and not command[1].startswith("-") else None
    mounts = _mounts(redis)
    assert command[0] == "redis-server" and config is not None and mounts.get(config) == str(REDIS_CONF), (
        f"redis runs {command} with mounts {mounts}; it must read deploy/redis/redis.conf, mounted"
    )
    data = command[command.index("--dir") + 1] if "--dir" in command else "/data"
    assert data in mounts, f"redis keeps its append-only file in {data!r}, which is not a mounted volume"
    aclfile = command[command.index("--aclfile") + 1] if "--aclfile" in command else None
    assert aclfile == f"{data}/{REDIS_ACL_FILE}" and f"> {aclfile} &&" in script, (
        f"redis must read the ACL file the script writes ({data}/{REDIS_ACL_FILE}), not {aclfile!r}"
    )


def test_postgres_has_the_database_the_services_use(services: dict[str, dict[str, Any]]) -> None:
    postgres = _service(services, "postgres")
    env = _env(postgres)
    for spec in LAUNCHER:
        url = _env(_service(services, spec.name)).get("REPRISE_DATABASE_URL")
        if url is None or urlsplit(url).hostname != "postgres":
            continue
        parts = urlsplit(url)
        wanted = {
            "POSTGRES_DB": parts.path.lstrip("/"),
            "POSTGRES_USER": parts.username,
            "POSTGRES_PASSWORD": parts.password,
        }
        drifted = {key: (env.get(key), value) for key, value in wanted.items() if env.get(key) != value}
        assert not drifted, f"{spec.name}: REPRISE_DATABASE_URL disagrees with postgres (postgres, url): {drifted}"
    assert "healthcheck" in postgres, "postgres has no healthcheck, so depends_on: service_healthy never passes"


def test_named_volumes_are_declared(services: dict[str, dict[str, Any]], volumes: dict[str, Any]) -> None:
    for name in INFRASTRUCTURE:
        named = {source for source in _mounts(_service(services, name)).values() if not source.startswith("/")}
        assert named, f"{name} keeps its data in no named volume"
        undeclared = named - set(volumes)
        assert not undeclared, f"{name} uses volumes {sorted(undeclared)} that the top-level volumes: does not declare"
