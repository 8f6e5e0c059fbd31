"""The coordinator and participant processes of a saga phase, started as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from saga.streams import ConfigurationError
from saga.streams.kafka import KafkaSettings
from saga.tools.bench.config import PARTICIPANTS, TARGET_OF, BenchConfig, Layout


@contextmanager
def saga_processes(
    cfg: BenchConfig,
    layout: Layout,
    settings: KafkaSettings,
    logs: Path,
    keys_dir: Path | None = None,
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """The coordinator and ``workers`` processes per participant, as the user would run them.

    Each participant runs on the store ``layout`` gives it; two participants on one
    PostgreSQL database share its ledger table, whose rows and advisory locks are
    per participant (:mod:`participants._sql`), so they do not collide.

    ``keys_dir``: signed records (``SAGA_KEYS_DIR`` in their environment); without it
    they run unsigned, whatever the environment of ``saga bench`` says.
    """
    logs.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "SAGA_KEYS_DIR"}
    if keys_dir is not None:
        env["SAGA_KEYS_DIR"] = str(keys_dir)
    common = ["--bootstrap", settings.bootstrap, "--prefix", settings.prefix]
    urls = {
        "postgres": cfg.postgres_url,
        "ferretdb": cfg.mongo_url,
        "redis": cfg.redis_url,
        "mariadb": cfg.mariadb_url,
    }
    storage_urls: dict[str, str] = {}  # SAGA_STORAGE_URL: ps would show a password
    commands: dict[str, list[str]] = {
        "coordinator": [
            *("coordinator", "run", *common, "--instance-id", "bench"),
            *("--participants", ",".join(PARTICIPANTS)),
        ]
    }
    for name in PARTICIPANTS:
        storage = layout.kind(name)
        for w in range(cfg.workers):
            label = f"{name}#{w} ({storage})"
            commands[label] = [
                *("participant", "run", *common, "--name", name, "--storage", storage),
                *("--schema", cfg.schema, "--targets", TARGET_OF[name]),
            ]
            storage_urls[label] = urls[layout.stores[name]]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, args in commands.items():
            log_name = name.split(" ")[0].replace("#", "-")
            with (logs / f"{log_name}.log").open("wb") as log:
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "coordinator", *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**env, "SAGA_STORAGE_URL": storage_urls[name]}
                    if name in storage_urls
                    else env,
                )
        yield procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def check_alive(procs: Mapping[str, subprocess.Popen[bytes]], logs: Path) -> None:
    for name, p in procs.items():
        if p.poll() is not None:
            raise ConfigurationError(
                f"the {name} process exited early (status {p.returncode}); see its log in {logs}"
            )
