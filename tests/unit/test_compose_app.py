"""Static checks that the compose app profile can work (no Docker engine needed).

`docker compose --profile app up` must bring up a working system: an init step
creates the topics and the demo's data before anything uses them, the participants
use that data, each scaled coordinator has its own instance id (a shared one would
make the replicas fence one another), the image holds the Spark jars fetched as the
local setup fetches them, and no internal note is left in the compose file or the
Dockerfile. The helpers and fixtures are those of tests/unit/test_compose.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.test_compose import (
    COMPOSE,
    DOCKERFILE,
    INIT,
    PARTICIPANTS,
    compose,
    compose_text,
    config,
    depends_of,
    dockerfile_instructions,
    env_of,
    option,
    services,
    with_defaults,
    words_of,
)

pytestmark = pytest.mark.unit

# Fixtures come from test_compose.py (imported names are how pytest finds them here).
__all__ = ["compose", "compose_text", "config", "services"]


def test_init_creates_topics_and_data_before_the_application(
    services: dict[str, dict[str, Any]],
) -> None:
    """`saga demo --setup-only` creates the topics and the demo's data (idempotently)."""
    svc = services[INIT]
    words = words_of(svc.get("command"))
    assert words[:2] == ["demo", "--setup-only"], (
        f"{INIT}: the command should be `demo --setup-only ...` (entrypoint saga), it is {words}"
    )
    assert option(words, "--partitions"), f"{INIT}: no explicit --partitions in {words}"
    assert str(svc.get("restart")) == "no", f"{INIT}: a one-shot step must not restart"
    for dep in ("kafka", "postgres", "mongo", "redis"):
        assert depends_of(svc).get(dep) == "service_healthy", (
            f"{INIT}: must wait for {dep} to be healthy"
        )
    env = env_of(svc)
    for var, backing in (
        ("SAGA_POSTGRES_URL", "postgres"),
        ("SAGA_MONGO_URL", "mongo"),
        ("SAGA_REDIS_URL", "redis"),
    ):
        url = with_defaults(env.get(var, ""))
        assert f"@{backing}:" in url or f"//{backing}:" in url, (
            f"{INIT}: {var} is {url!r}, not an address of the {backing!r} service"
        )
    assert not any("://" in w for w in words), f"{INIT}: a store URL on the command line: {words}"
    for name in ("coordinator", *PARTICIPANTS):
        cond = depends_of(services[name]).get(INIT)
        assert cond == "service_completed_successfully", (
            f"service {name!r} must wait for `{INIT}` to complete successfully (it waits: {cond!r})"
        )


# participant -> (its target, what the demo's setup creates for it)
DEMO_TARGETS = {
    "participant-ledger": "accounts",
    "participant-inventory": "stock",
    "participant-loyalty": "points",
}


@pytest.mark.parametrize("name", PARTICIPANTS)
def test_participants_use_the_data_init_creates(
    services: dict[str, dict[str, Any]], name: str
) -> None:
    """The demo's setup puts its data under one schema / database / key prefix."""
    from saga.tools.demo import SCHEMA

    words = words_of(services[name].get("command"))
    assert option(words, "--schema") == SCHEMA, (
        f"{name}: --schema is {option(words, '--schema')!r}, but the init step creates the "
        f"demo's data under {SCHEMA!r}"
    )
    assert option(words, "--targets") == DEMO_TARGETS[name], (
        f"{name}: --targets is {option(words, '--targets')!r}; the init step creates "
        f"{DEMO_TARGETS[name]!r}"
    )


def test_scaled_coordinators_get_distinct_instance_ids(
    services: dict[str, dict[str, Any]],
) -> None:
    """Every replica would share an --instance-id, SAGA_INSTANCE_ID or hostname given here,
    and with it a transactional id: the replicas would fence one another. Without them
    each takes its container's host name (coordinator.cli.default_instance_id)."""
    svc = services["coordinator"]
    words = words_of(svc.get("command"))
    assert "--instance-id" not in words, f"coordinator: one --instance-id for all replicas: {words}"
    assert "SAGA_INSTANCE_ID" not in env_of(svc), "coordinator: one SAGA_INSTANCE_ID for all"
    assert "hostname" not in svc, "coordinator: a fixed hostname is every replica's instance id"


def test_no_internal_notes_are_left(compose_text: str) -> None:
    for path, text in ((COMPOSE, compose_text), (DOCKERFILE, DOCKERFILE.read_text("utf-8"))):
        for word in ("placeholder", "TODO", "FIXME", "XXX"):
            assert word.lower() not in text.lower(), f"{path.name} still says {word!r}"


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM"]
    return instructions[starts[-1] :]


def test_dockerfile_ships_the_spark_jars_fetched_as_the_local_setup_does(
    config: dict[str, str],
) -> None:
    """A build stage runs the same Maven fetch as infra/services.sh (same pom, settings and
    versions); the final stage copies its jars and points SAGA_SPARK_JARS at them."""
    instructions = dockerfile_instructions()
    runs = " ".join(rest for keyword, rest in instructions if keyword == "RUN")
    assert "dependency:copy-dependencies" in runs, "the Dockerfile fetches no jars with Maven"
    for needed in ("infra/spark/pom.xml", "infra/maven-settings.xml", "-DexcludeTransitive=true"):
        assert needed in runs, f"the Dockerfile's Maven fetch lacks {needed}"
    args = dict(
        rest.split("=", 1) for keyword, rest in instructions if keyword == "ARG" and "=" in rest
    )
    for name in (
        "SPARK_VERSION",
        "KAFKA_CLIENTS_FOR_SPARK",
        "COMMONS_POOL2_VERSION",
        "POSTGRES_JDBC_VERSION",
    ):
        assert args.get(name) == config[name], (
            f"the Dockerfile's ARG {name} is {args.get(name)!r}, infra/config.env says "
            f"{config[name]!r}"
        )
    final = final_stage(instructions)
    copied = [rest for keyword, rest in final if keyword == "COPY" and "--from=" in rest]
    assert copied, "the final stage copies no jars from the Maven stage"
    target = copied[0].split()[-1]
    env = " ".join(rest for keyword, rest in final if keyword == "ENV")
    assert f"SAGA_SPARK_JARS={target}" in env, (
        f"the final stage does not set SAGA_SPARK_JARS to the jars' folder {target}"
    )
