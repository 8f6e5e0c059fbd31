"""Static checks of docker-compose.yml and the Dockerfile (no Docker engine needed).

The compose file must describe the same system as the local, no-Docker
services (infra/services.sh): same host ports, same credentials, same
Kafka settings that matter (docs/architecture.md §5). Its app profile must be
able to work: an init step creates the topics and the demo's data before anything
uses them, the participants use that data, each scaled coordinator has its own
instance id, the image holds the Spark jars and every extra, and no internal note
is left in either file.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
CONFIG_ENV = ROOT / "infra" / "config.env"
SERVICES_SH = ROOT / "infra" / "services.sh"

INFRA_SERVICES = ("kafka", "postgres", "mongo", "redis", "spark-master", "spark-worker")
PARTICIPANTS = ("participant-ledger", "participant-inventory", "participant-loyalty")
INIT = "init"
APP_SERVICES = (INIT, "coordinator", *PARTICIPANTS)
APP_PROFILE = "app"

# config.env port -> (compose service, port inside the container); Kafka's is
# the port of its EXTERNAL listener, found in KAFKA_LISTENERS.
PUBLISHED_PORTS = {
    "KAFKA_PORT": ("kafka", None),
    "POSTGRES_PORT": ("postgres", 5432),
    "MONGO_PORT": ("mongo", 27017),
    "REDIS_PORT": ("redis", 6379),
}

# participant --storage -> the compose service holding that storage
STORAGE_SERVICE = {"sql": "postgres", "mongo": "mongo", "redis": "redis"}

# `${NAME:-default}` in a compose value
INTERPOLATION = re.compile(r"\$\{(?P<name>[A-Z_]+):-(?P<default>[^}]*)\}")


# ---------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def compose_text() -> str:
    assert COMPOSE.is_file(), f"{COMPOSE} is missing"
    return COMPOSE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def compose(compose_text: str) -> dict[str, Any]:
    doc = yaml.safe_load(compose_text)
    assert isinstance(doc, dict), "docker-compose.yml is not a mapping at the top level"
    assert isinstance(doc.get("services"), dict), "docker-compose.yml has no `services` mapping"
    return doc


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, svc in compose["services"].items():
        assert isinstance(svc, dict), f"service {name!r} is not a mapping"
        out[name] = svc
    return out


@pytest.fixture(scope="module")
def config() -> dict[str, str]:
    """The defaults of infra/config.env's `NAME=${NAME:-value}` lines."""
    assert CONFIG_ENV.is_file(), f"{CONFIG_ENV} is missing"
    pattern = re.compile(r"^([A-Z][A-Z0-9_]*)=\$\{\1:-([^}]*)\}", re.MULTILINE)
    values = dict(pattern.findall(CONFIG_ENV.read_text(encoding="utf-8")))
    for name in (*PUBLISHED_PORTS, "POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB"):
        assert name in values, f"infra/config.env has no `{name}=${{{name}:-value}}` line"
    return values


def env_of(svc: dict[str, Any]) -> dict[str, str]:
    """A service's environment as strings, from either the mapping or the list form."""
    raw = svc.get("environment") or {}
    if isinstance(raw, list):
        pairs = (item.split("=", 1) if "=" in item else (item, "") for item in raw)
        return {k: v for k, v in pairs}
    return {str(k): "" if v is None else str(v) for k, v in raw.items()}


def words_of(value: Any) -> list[str]:
    """A command or healthcheck test as a list of words, from either the list or the string form."""
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    return [str(w) for w in value]


def script_words(value: Any) -> list[str]:
    """The words of a command, with a `sh -c SCRIPT` command's script split into words too."""
    words = words_of(value)
    if words[:2] == ["sh", "-c"] and len(words) >= 3:
        return shlex.split(words[2])
    return words


def with_defaults(value: str) -> str:
    """A compose value with each `${NAME:-default}` replaced by its default."""
    return INTERPOLATION.sub(lambda m: m["default"], value)


def storage_url(svc: dict[str, Any]) -> str:
    """A participant's storage URL: its --url, else its SAGA_STORAGE_URL (defaults filled in)."""
    return with_defaults(option(words_of(svc.get("command")), "--url") or "") or with_defaults(
        env_of(svc).get("SAGA_STORAGE_URL", "")
    )


def depends_of(svc: dict[str, Any]) -> dict[str, str]:
    """depends_on as {service: condition}, from either the list or the mapping form."""
    raw = svc.get("depends_on") or {}
    if isinstance(raw, list):
        return {str(name): "service_started" for name in raw}
    return {
        str(name): str((spec or {}).get("condition", "service_started"))
        for name, spec in raw.items()
    }


def ports_of(name: str, svc: dict[str, Any]) -> list[tuple[int | None, int]]:
    """Published ports as (host port or None, container port), short or long syntax."""
    out: list[tuple[int | None, int]] = []
    for entry in svc.get("ports") or []:
        if isinstance(entry, dict):
            published = entry.get("published")
            out.append((int(published) if published is not None else None, int(entry["target"])))
            continue
        spec = str(entry).split("/", 1)[0]  # drop /tcp, /udp
        parts = spec.rsplit(":", 2)  # [ip:]host:container, or container alone
        assert all(p.isdigit() for p in parts[-2:]), (
            f"service {name!r}: cannot read port entry {entry!r} (ranges are not supported here)"
        )
        host = int(parts[-2]) if len(parts) >= 2 else None
        out.append((host, int(parts[-1])))
    return out


def listeners(value: str) -> dict[str, str]:
    """`NAME://host:port,...` as {NAME: host:port}."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in value.split(","))):
        listener_name, sep, address = item.partition("://")
        assert sep, f"listener {item!r} is not NAME://host:port"
        out[listener_name] = address
    return out


def option(words: list[str], flag: str) -> str | None:
    """The value after `flag` in a command line, or None."""
    if flag in words:
        i = words.index(flag)
        return words[i + 1] if i + 1 < len(words) else None
    return None


def kafka_env(services: dict[str, dict[str, Any]]) -> dict[str, str]:
    assert "kafka" in services, "there is no `kafka` service"
    return env_of(services["kafka"])


# ---------------------------------------------------------------- services


def test_every_required_service_exists(services: dict[str, dict[str, Any]]) -> None:
    missing = [s for s in (*INFRA_SERVICES, *APP_SERVICES) if s not in services]
    assert not missing, f"docker-compose.yml lacks the services {missing}"


def test_images_match_the_local_versions(
    services: dict[str, dict[str, Any]], config: dict[str, str]
) -> None:
    expected = {
        "kafka": f"apache/kafka:{config['KAFKA_VERSION']}",
        "spark-master": f"apache/spark:{config['SPARK_VERSION']}",
        "spark-worker": f"apache/spark:{config['SPARK_VERSION']}",
        "postgres": "postgres:16",
        "mongo": "mongo:7",
        "redis": "redis:7",
    }
    for name, image in expected.items():
        got = services[name].get("image")
        assert got == image, f"service {name!r} runs image {got!r}, expected {image!r}"


# ---------------------------------------------------------------- kafka


def test_kafka_is_a_single_kraft_node(
    services: dict[str, dict[str, Any]], compose_text: str
) -> None:
    env = kafka_env(services)
    roles = {r.strip() for r in env.get("KAFKA_PROCESS_ROLES", "").split(",")}
    assert {"broker", "controller"} <= roles, (
        f"KAFKA_PROCESS_ROLES is {env.get('KAFKA_PROCESS_ROLES')!r}: KRaft needs broker,controller"
    )
    assert env.get("KAFKA_NODE_ID"), "kafka: KAFKA_NODE_ID is not set"
    voters = env.get("KAFKA_CONTROLLER_QUORUM_VOTERS", "")
    assert voters.startswith(f"{env.get('KAFKA_NODE_ID')}@"), (
        f"kafka: KAFKA_CONTROLLER_QUORUM_VOTERS {voters!r} does not name node "
        f"{env.get('KAFKA_NODE_ID')!r} as the voter"
    )
    assert "zookeeper" not in compose_text.lower(), (
        "docker-compose.yml mentions ZooKeeper: Kafka 4 runs KRaft only"
    )


def test_kafka_settings_that_matter(services: dict[str, dict[str, Any]]) -> None:
    env = kafka_env(services)
    assert env.get("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "").lower() == "false", (
        'kafka: KAFKA_AUTO_CREATE_TOPICS_ENABLE must be "false" '
        "(the project creates its topics with an explicit partition count)"
    )
    for key in (
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
    ):
        assert env.get(key) == "1", (
            f"kafka: {key} is {env.get(key)!r}, must be 1 on a single broker "
            "(or transactional producers cannot initialise)"
        )
    assert env.get("KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS") == "0", (
        "kafka: KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS should be 0 so consumers start at once"
    )


def test_kafka_listeners_serve_containers_and_host(
    services: dict[str, dict[str, Any]], config: dict[str, str]
) -> None:
    env = kafka_env(services)
    bound = listeners(env.get("KAFKA_LISTENERS", ""))
    advertised = listeners(env.get("KAFKA_ADVERTISED_LISTENERS", ""))
    for required in ("PLAINTEXT", "CONTROLLER", "EXTERNAL"):
        assert required in bound, f"kafka: KAFKA_LISTENERS has no {required} listener: {bound}"
    assert advertised.get("EXTERNAL") == f"localhost:{config['KAFKA_PORT']}", (
        f"kafka: the EXTERNAL listener is advertised as {advertised.get('EXTERNAL')!r}, "
        f"expected localhost:{config['KAFKA_PORT']} (what the host connects to)"
    )
    assert "CONTROLLER" not in advertised, "kafka: the CONTROLLER listener must not be advertised"
    protocol_map = dict(
        item.strip().split(":", 1)
        for item in env.get("KAFKA_LISTENER_SECURITY_PROTOCOL_MAP", "").split(",")
        if ":" in item
    )
    unmapped = set(bound) - set(protocol_map)
    assert not unmapped, f"kafka: KAFKA_LISTENER_SECURITY_PROTOCOL_MAP lacks {sorted(unmapped)}"
    assert env.get("KAFKA_CONTROLLER_LISTENER_NAMES") in bound, (
        "kafka: KAFKA_CONTROLLER_LISTENER_NAMES does not name a listener in KAFKA_LISTENERS"
    )
    assert env.get("KAFKA_INTER_BROKER_LISTENER_NAME") in advertised, (
        "kafka: KAFKA_INTER_BROKER_LISTENER_NAME does not name an advertised listener"
    )
    # The application containers reach Kafka on the advertised PLAINTEXT address.
    inside = advertised.get("PLAINTEXT")
    for name in APP_SERVICES:
        got = env_of(services[name]).get("SAGA_KAFKA_BOOTSTRAP")
        assert got == inside, (
            f"service {name!r}: SAGA_KAFKA_BOOTSTRAP is {got!r}, expected Kafka's advertised "
            f"PLAINTEXT address {inside!r}"
        )


def test_kafka_healthcheck_asks_the_broker(services: dict[str, dict[str, Any]]) -> None:
    test = " ".join(words_of((services["kafka"].get("healthcheck") or {}).get("test")))
    assert "/opt/kafka/bin/kafka-broker-api-versions.sh" in test, (
        f"kafka: the healthcheck should run kafka-broker-api-versions.sh, it runs {test!r}"
    )


def test_kafka_keeps_its_log_in_a_named_volume(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    assert_named_volume(compose, "kafka", services["kafka"])


# ---------------------------------------------------------------- storages


def assert_named_volume(compose: dict[str, Any], name: str, svc: dict[str, Any]) -> None:
    declared = set((compose.get("volumes") or {}).keys())
    sources = []
    for vol in svc.get("volumes") or []:
        source = vol.get("source") if isinstance(vol, dict) else str(vol).split(":", 1)[0]
        sources.append(source)
    assert any(s in declared for s in sources), (
        f"service {name!r} keeps no data in a named volume (its volumes: {sources}, "
        f"declared: {sorted(declared)})"
    )


@pytest.mark.parametrize("name", ["postgres", "mongo", "redis"])
def test_storages_keep_data_in_named_volumes(
    compose: dict[str, Any], services: dict[str, dict[str, Any]], name: str
) -> None:
    assert_named_volume(compose, name, services[name])


def test_postgres_credentials_match_config_env(
    services: dict[str, dict[str, Any]], config: dict[str, str]
) -> None:
    env = env_of(services["postgres"])
    for key in ("POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB"):
        assert env.get(key) == config[key], (
            f"postgres: {key} is {env.get(key)!r}, infra/config.env says {config[key]!r}"
        )
    test = words_of((services["postgres"].get("healthcheck") or {}).get("test"))
    assert "pg_isready" in " ".join(test), (
        f"postgres: the healthcheck should use pg_isready: {test}"
    )


def test_redis_appends_every_write(services: dict[str, dict[str, Any]]) -> None:
    words = script_words(services["redis"].get("command"))
    assert option(words, "--appendonly") == "yes", (
        f"redis: the command must include `--appendonly yes` (AOF on), it is {words}"
    )


def test_postgres_asks_for_passwords(services: dict[str, dict[str, Any]]) -> None:
    env = env_of(services["postgres"])
    assert env.get("POSTGRES_HOST_AUTH_METHOD") == "scram-sha-256", (
        "postgres: POSTGRES_HOST_AUTH_METHOD should be scram-sha-256, as the local "
        f"services' pg_hba.conf; it is {env.get('POSTGRES_HOST_AUTH_METHOD')!r}"
    )


def test_redis_asks_for_its_password_without_showing_it(
    services: dict[str, dict[str, Any]],
) -> None:
    """requirepass comes from REDIS_PASSWORD through a config file (never a command-line
    argument, which `ps` shows), and the healthcheck authenticates."""
    svc = services["redis"]
    assert env_of(svc).get("REDIS_PASSWORD"), "redis: no REDIS_PASSWORD in its environment"
    words = script_words(svc.get("command"))
    assert "--requirepass" not in words, f"redis: the password is on the command line: {words}"
    script = " ".join(words_of(svc.get("command")))
    assert "requirepass" in script and "$$REDIS_PASSWORD" in script, (
        f"redis: the command does not set requirepass from $REDIS_PASSWORD: {script}"
    )
    test = " ".join(words_of((svc.get("healthcheck") or {}).get("test")))
    assert "REDISCLI_AUTH" in test, f"redis: the healthcheck does not authenticate: {test}"


def test_mongo_is_a_replica_set(services: dict[str, dict[str, Any]]) -> None:
    words = words_of(services["mongo"].get("command"))
    assert option(words, "--replSet"), f"mongo: the command must include --replSet NAME: {words}"
    test = " ".join(words_of((services["mongo"].get("healthcheck") or {}).get("test")))
    assert "rs.initiate" in test, (
        "mongo: the healthcheck must initiate the replica set (rs.initiate), "
        "or the single node never becomes primary"
    )


# ---------------------------------------------------------------- wiring


def test_depends_on_names_existing_services(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        for dep, condition in depends_of(svc).items():
            assert dep in services, f"service {name!r} depends on {dep!r}, which does not exist"
            assert dep != name, f"service {name!r} depends on itself"
            if condition == "service_healthy":
                assert services[dep].get("healthcheck"), (
                    f"service {name!r} waits for {dep!r} to be healthy, "
                    f"but {dep!r} has no healthcheck"
                )
            if not svc.get("profiles"):
                assert not services[dep].get("profiles"), (
                    f"service {name!r} starts without a profile but depends on {dep!r}, "
                    f"which only starts with --profile {services[dep].get('profiles')}"
                )


def test_every_healthcheck_has_a_test(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        if "healthcheck" not in svc:
            continue
        test = words_of((svc["healthcheck"] or {}).get("test"))
        assert test and test[0] != "NONE", f"service {name!r} has a healthcheck without a test"
        if test[0] in ("CMD", "CMD-SHELL"):
            assert len(test) > 1, f"service {name!r}: the healthcheck test is only {test[0]!r}"


def test_host_ports_are_unique(services: dict[str, dict[str, Any]]) -> None:
    seen: dict[int, str] = {}
    for name, svc in services.items():
        for host, _ in ports_of(name, svc):
            if host is None:
                continue
            assert host not in seen, (
                f"host port {host} is published by both {seen[host]!r} and {name!r}"
            )
            seen[host] = name


@pytest.mark.parametrize("port_name", sorted(PUBLISHED_PORTS))
def test_published_ports_match_config_env(
    services: dict[str, dict[str, Any]], config: dict[str, str], port_name: str
) -> None:
    name, target = PUBLISHED_PORTS[port_name]
    if target is None:  # Kafka: the port of its EXTERNAL listener
        external = listeners(kafka_env(services).get("KAFKA_LISTENERS", "")).get("EXTERNAL", "")
        target = int(external.rsplit(":", 1)[-1])
    published = [host for host, inside in ports_of(name, services[name]) if inside == target]
    assert published == [int(config[port_name])], (
        f"service {name!r} publishes container port {target} on host ports {published}, "
        f"but infra/config.env has {port_name}={config[port_name]}: "
        "the Docker and the local setups must expose the same addresses"
    )


def test_infrastructure_starts_without_a_profile(services: dict[str, dict[str, Any]]) -> None:
    for name in INFRA_SERVICES:
        assert not services[name].get("profiles"), (
            f"service {name!r} is infrastructure: it must start with a plain `docker compose up`"
        )
        assert "build" not in services[name], f"service {name!r} should run an image, not a build"


def test_app_services_are_built_and_in_the_app_profile(
    services: dict[str, dict[str, Any]],
) -> None:
    for name in APP_SERVICES:
        svc = services[name]
        assert APP_PROFILE in (svc.get("profiles") or []), (
            f"service {name!r} is not in the {APP_PROFILE!r} profile, so `docker compose up` "
            "would start it with the infrastructure"
        )
        assert "build" in svc, f"service {name!r} does not `build` the project's image"
    for name, svc in services.items():
        if "build" in svc:
            assert APP_PROFILE in (svc.get("profiles") or []), (
                f"service {name!r} builds the project but is not in the {APP_PROFILE!r} profile"
            )


def test_coordinator_runs_with_replicas(services: dict[str, dict[str, Any]]) -> None:
    svc = services["coordinator"]
    assert words_of(svc.get("command"))[:2] == ["coordinator", "run"], (
        f"coordinator: the command should be `coordinator run`, it is {svc.get('command')}"
    )
    replicas = (svc.get("deploy") or {}).get("replicas")
    assert isinstance(replicas, int) and replicas >= 1, (
        f"coordinator: deploy.replicas should be a positive number, it is {replicas!r}"
    )
    assert "container_name" not in svc, "coordinator: container_name prevents more replicas"


@pytest.mark.parametrize("name", PARTICIPANTS)
def test_participants_use_their_storage(services: dict[str, dict[str, Any]], name: str) -> None:
    svc = services[name]
    words = words_of(svc.get("command"))
    assert words[:2] == ["participant", "run"], (
        f"{name}: the command should be `participant run ...`, it is {words}"
    )
    assert option(words, "--name") == name.removeprefix("participant-"), (
        f"{name}: --name is {option(words, '--name')!r}"
    )
    storage = option(words, "--storage")
    assert storage in STORAGE_SERVICE, f"{name}: unknown --storage {storage!r}"
    backing = STORAGE_SERVICE[storage]
    url = storage_url(svc)
    assert f"@{backing}:" in url or f"//{backing}:" in url, (
        f"{name}: the storage URL {url!r} does not point at the {backing!r} service"
    )
    if backing in ("postgres", "redis"):
        assert ":" in url.split("//", 1)[1].split("@", 1)[0] and "@" in url, (
            f"{name}: the storage URL {url!r} has no password, but {backing} asks for one"
        )
        assert "@" not in (option(words, "--url") or ""), (
            f"{name}: a URL with a password on the command line (ps shows it): "
            "use SAGA_STORAGE_URL in the environment"
        )
    env = env_of(svc)
    assert env.get("SAGA_KAFKA_BOOTSTRAP") == env_of(services["coordinator"]).get(
        "SAGA_KAFKA_BOOTSTRAP"
    ), f"{name}: its own environment lost SAGA_KAFKA_BOOTSTRAP"
    assert option(words, "--targets"), f"{name}: no --targets"
    assert depends_of(svc).get(backing) == "service_healthy", (
        f"{name}: must wait for {backing!r} to be healthy"
    )


# ---------------------------------------------------------------- documentation


def test_header_comment_gives_the_same_addresses_as_the_local_setup(
    compose_text: str, config: dict[str, str]
) -> None:
    header_lines = []
    for line in compose_text.splitlines():
        if line.strip() and not line.startswith("#"):
            break
        header_lines.append(line)
    header = "\n".join(header_lines)
    assert "docker compose up -d" in header, "the top comment does not say `docker compose up -d`"
    assert "--profile app" in header, "the top comment does not say how to start `--profile app`"
    user, password, db = (config[k] for k in ("POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB"))
    redis_env = env_of(yaml.safe_load(compose_text)["services"]["redis"])
    redis_password = with_defaults(redis_env.get("REDIS_PASSWORD", ""))
    expected = {
        "SAGA_KAFKA_BOOTSTRAP": f"localhost:{config['KAFKA_PORT']}",
        "SAGA_POSTGRES_URL": f"postgresql://{user}:{password}@localhost:{config['POSTGRES_PORT']}/{db}",
        "SAGA_MONGO_URL": f"mongodb://localhost:{config['MONGO_PORT']}/",
        "SAGA_REDIS_URL": f"redis://:{redis_password}@localhost:{config['REDIS_PORT']}/0",
        "SAGA_MARIADB_URL": f"mariadb://saga:saga@localhost:{config['MARIADB_PORT']}/saga",
    }
    for var, value in expected.items():
        assert re.search(rf"{var}='?{re.escape(value)}", header), (
            f"the top comment does not export {var}={value}..."
        )
    # Every address the local setup exports (but its jar folder and Kafka's SASL listener,
    # which only the local services have) is given for Docker too.
    local = set(re.findall(r"export (SAGA_[A-Z_]+)=", SERVICES_SH.read_text(encoding="utf-8")))
    local_only = {"SAGA_SPARK_JARS", "SAGA_SASL_BOOTSTRAP", "SAGA_SASL_CA", "SAGA_SASL_USERS"}
    missing = sorted(local - local_only - set(expected))
    assert not missing, f"infra/services.sh exports {missing}, which this test does not check"


# ---------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    assert DOCKERFILE.is_file(), f"{DOCKERFILE} is missing"
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    out = []
    for raw in joined.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_dockerfile_entrypoint_is_saga() -> None:
    entrypoints = [rest for keyword, rest in dockerfile_instructions() if keyword == "ENTRYPOINT"]
    assert entrypoints, "the Dockerfile has no ENTRYPOINT"
    last = entrypoints[-1]
    try:
        argv = json.loads(last)
    except json.JSONDecodeError:
        pytest.fail(f"the Dockerfile's ENTRYPOINT {last!r} is not the exec (JSON) form")
    assert argv == ["saga"], f'the Dockerfile\'s ENTRYPOINT is {argv}, expected ["saga"]'


def test_dockerfile_builds_the_project_with_a_jre() -> None:
    instructions = dockerfile_instructions()
    froms = [rest for keyword, rest in instructions if keyword == "FROM"]
    assert froms and froms[-1].split()[0] == "python:3.11-slim", (
        f"the Dockerfile's final stage starts FROM {froms}, expected python:3.11-slim"
    )
    runs = " ".join(rest for keyword, rest in instructions if keyword == "RUN")
    assert "default-jre-headless" in runs, (
        "the Dockerfile does not install default-jre-headless (pyspark needs a JRE)"
    )
    # Every extra: the participants' drivers, pyspark, and the tools (the init step).
    assert re.search(r"pip install '?\.\[all\]'?(\s|$)", runs), (
        "the Dockerfile does not `pip install '.[all]'`"
    )
