"""A whole saga system for end-to-end tests: real processes on real services.

``SagaSystem`` creates a unique topic prefix and starts ``saga coordinator run``
and ``saga participant run`` as subprocesses (so kill -9 is a real crash), with
their logs in the test's tmp folder. Tests talk to it through the real client
library and read the stores directly.

``SagaSystem(..., signing=["bank", "shop"])`` runs it with signed records: a key
folder in the test's tmp folder holds a key pair for the coordinator, the client,
the operator and ``participant-<name>`` for each name given, every process gets
``SAGA_KEYS_DIR`` and :meth:`SagaSystem.client` signs with the client's key. By
default (``signing=None``) nothing is signed, as before.

Participant registry: :meth:`SagaSystem.coordinator` passes ``--unknown-participants
accept`` unless told ``unknown_participants="reject"`` (the command's default). Many
tests start a participant after their first requests on purpose (one that is down
past a deadline, one restarted after a crash), which is the case the override is
for; the registry's own tests pass ``"reject"`` and wait for the participants'
announcements with :meth:`SagaSystem.wait_announced` before they submit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa

from saga.coordinator import SagaClient
from saga.streams import Decision, StepEvent, StepsCommitted, decode, step_events
from saga.streams._signing import (
    CLIENT,
    COORDINATOR,
    OPERATOR,
    Keyring,
    create_key,
    participant_principal,
)
from saga.streams.kafka import (
    Consumer,
    KafkaSettings,
    Message,
    Producer,
    create_topics,
    delete_topics,
)
from tests._infra import Services, sqlalchemy_url, unique_name


@dataclass
class Proc:
    """One saga subprocess and its log file."""

    name: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            # The test launcher: the saga command, plus SAGA_FAULTS (tests/launch.py).
            [sys.executable, "-m", "tests.launch", *self.args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return self

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
                self.popen.wait(30)

    def wait_exit(self, timeout: float) -> int:
        assert self.popen is not None
        return self.popen.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class SagaSystem:
    services: Services
    tmp: Path
    schema: str
    partitions: int = 4
    prefix: str = field(default_factory=lambda: unique_name("saga"))
    procs: list[Proc] = field(default_factory=list)
    # Extra environment for every process started from now on, e.g.
    # {"SAGA_KAFKA_SESSION_TIMEOUT_MS": "6000"} (SAGA_KAFKA_<NAME> sets a librdkafka setting).
    extra_env: dict[str, str] = field(default_factory=dict)
    # Log level of the processes started from now on: 1 = info, 2 = debug (``saga -v``).
    verbose: int = 0
    # Signed records: the participants to make keys for (None: signing off, the default).
    # Keys are made once, before any process starts, in <tmp>/keys (SAGA_KEYS_DIR).
    signing: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if self.signing is not None:
            for principal in (
                COORDINATOR,
                CLIENT,
                OPERATOR,
                *(participant_principal(name) for name in self.signing),
            ):
                create_key(self.keys_dir, principal)

    @property
    def keys_dir(self) -> Path:
        """The key folder of a signing system (see ``signing``)."""
        return self.tmp / "keys"

    def keyring(self, principal: str | None) -> Keyring:
        """The key folder's public keys and ``principal``'s private key (None: none)."""
        assert self.signing is not None, "this system runs without signing"
        return Keyring.load(self.keys_dir, principal)

    @property
    def settings(self) -> KafkaSettings:
        return KafkaSettings(bootstrap=self.services.kafka_bootstrap, prefix=self.prefix)

    def env(self, faults: str | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env["SAGA_KAFKA_BOOTSTRAP"] = self.services.kafka_bootstrap
        env["SAGA_TOPIC_PREFIX"] = self.prefix
        env.pop("SAGA_FAULTS", None)
        env.pop("SAGA_KEYS_DIR", None)
        env.pop("SAGA_STORAGE_URL", None)
        if self.signing is not None:
            env["SAGA_KEYS_DIR"] = str(self.keys_dir)
        env.update(self.extra_env)
        if faults:
            env["SAGA_FAULTS"] = faults
        return env

    def create_topics(self) -> None:
        create_topics(self.settings, self.partitions)

    def delete_topics(self) -> None:
        delete_topics(self.settings, list(self.settings.topics.all))

    @contextmanager
    def opened(self) -> Iterator[SagaSystem]:
        """Its topics created; every process stopped and the topics deleted after."""
        self.create_topics()
        try:
            yield self
        finally:
            self.stop_all()
            self.delete_topics()

    def start(self, name: str, args: Sequence[str], faults: str | None = None) -> Proc:
        """Start ``saga <args>``; a ``--url`` goes through SAGA_STORAGE_URL (not ``ps``)."""
        flags = ["-v"] * self.verbose
        args, env = list(args), self.env(faults)
        if "--url" in args:
            at = args.index("--url")
            env["SAGA_STORAGE_URL"] = args[at + 1]
            del args[at : at + 2]
        proc = Proc(name, [*flags, *args], env, self.tmp / f"{name}.log").start()
        self.procs.append(proc)
        return proc

    def coordinator(
        self,
        instance_id: str = "0",
        faults: str | None = None,
        participants: Sequence[str] | None = None,
        unknown_participants: Literal["accept", "reject"] = "accept",
        extra: Sequence[str] = (),
    ) -> Proc:
        """Start ``saga coordinator run``; ``participants`` passes ``--participants a,b``,
        ``unknown_participants`` ``--unknown-participants`` (see the module docstring);
        ``extra``: more options (``--participant-grace 2s``, ...)."""
        args = ["coordinator", "run", "--instance-id", instance_id]
        if participants is not None:
            args += ["--participants", ",".join(participants)]
        args += ["--unknown-participants", unknown_participants, *extra]
        return self.start(f"coordinator-{instance_id}", args, faults)

    def wait_announced(self, *names: str, timeout: float = 60.0) -> None:
        """Return once each of ``names`` is up on the participant registry."""
        from saga.streams._registry import read_registry

        deadline = time.monotonic() + timeout
        while True:
            registry = read_registry(self.settings, timeout=10)
            up = {p.name for p in registry.participants() if not p.gone}
            if set(names) <= up:
                return
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"participants {sorted(set(names) - up)} did not announce themselves "
                    f"within {timeout:g}s"
                )
            time.sleep(0.2)

    def participant(
        self,
        name: str,
        targets: Sequence[str],
        faults: str | None = None,
        tag: str = "",
        extra: Sequence[str] = (),
    ) -> Proc:
        """Start ``saga participant run`` (SQL, the test's schema); ``extra``: more options."""
        return self.start(
            f"participant-{name}{tag}",
            [
                "participant",
                "run",
                "--name",
                name,
                "--storage",
                "sql",
                "--url",
                self.services.postgres_url,
                "--schema",
                self.schema,
                "--targets",
                ",".join(targets),
                *extra,
            ],
            faults,
        )

    def stop_all(self) -> None:
        for p in self.procs:
            p.kill(signal.SIGTERM) if p.alive else None
        for p in self.procs:
            if p.alive:
                p.kill(signal.SIGKILL)

    @contextmanager
    def client(self) -> Iterator[SagaClient]:
        """The client library; signing with the client's key when the system signs."""
        if self.signing is None:
            with SagaClient(self.settings) as c:
                yield c
        else:
            with SagaClient(self.settings, keys=self.keyring(CLIENT)) as c:
                yield c

    def producer(self) -> Producer:
        return Producer(self.settings, client_id="test")

    def read_topic(self, topic: str, *, unless: str | None = None) -> list[Any]:
        """Every decodable record of a topic, in partition then offset order; with
        ``unless``, those without that header."""
        consumer = Consumer(self.settings, group_id=None, client_id="test-reader")
        try:
            records: list[Any] = []
            n = consumer.list_partitions(topic)
            for p in range(n):
                low, high = consumer.watermarks(topic, p)
                if high <= low:
                    continue
                consumer.assign([(topic, p, low)])
                deadline = time.monotonic() + 30
                done = False
                while not done and time.monotonic() < deadline:
                    for m in consumer.poll_batch(1000, 0.2):
                        if m.value is not None and (unless is None or m.header(unless) is None):
                            try:
                                records.append(decode(m.value))
                            except Exception:  # poison: not ours to judge here
                                records.append(("raw", m.value))
                        if m.offset + 1 >= high:
                            done = True
                    pos = consumer.position([(topic, p)])
                    if pos and all(v is not None and v >= high for v in pos.values()):
                        done = True
            return records
        finally:
            consumer.close()

    def read_messages(
        self,
        topic: str,
        isolation_level: Literal["read_committed", "read_uncommitted"] = "read_committed",
    ) -> list[Message]:
        """Every record of a topic as raw messages (key, value bytes, headers, offsets),
        in partition then offset order; ``read_uncommitted`` also shows aborted records."""
        consumer = Consumer(
            self.settings,
            group_id=None,
            client_id="test-raw-reader",
            isolation_level=isolation_level,
        )
        try:
            found: list[Message] = []
            for p in range(consumer.list_partitions(topic)):
                low, high = consumer.watermarks(topic, p)
                if high <= low:
                    continue
                consumer.assign([(topic, p, low)])
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    batch = consumer.poll_batch(1000, 0.2)
                    found.extend(batch)
                    if batch and batch[-1].offset + 1 >= high:
                        break
                    pos = consumer.position([(topic, p)])
                    if pos and all(v is not None and v >= high for v in pos.values()):
                        break
            return found
        finally:
            consumer.close()

    def decisions(self, tx_id: str) -> list[Decision]:
        return [
            r
            for r in self.read_topic(self.settings.topics.decisions)
            if isinstance(r, Decision) and r.tx_id == tx_id
        ]

    def events(self, tx_id: str) -> list[StepEvent]:
        """The step events of ``tx_id`` on the events topic (see :func:`step_events_of`)."""
        return [e for e in self.step_events() if e.tx_id == tx_id]

    def step_events(self) -> list[StepEvent]:
        """Every step event on the events topic (see :func:`step_events_of`)."""
        return step_events_of(self.read_topic(self.settings.topics.events))


def step_events_of(records: Iterable[object]) -> list[StepEvent]:
    """The step events that records read from the events topic stand for, in order.

    A ``saga.step`` is itself; a ``saga.committed`` (one per participant batch and
    events partition) is one ``committed`` event per step it lists, whatever its key;
    anything else (poison) is passed over.
    """
    return [e for r in records if isinstance(r, StepEvent | StepsCommitted) for e in step_events(r)]


def bank_schema(engine: sa.Engine, schema: str) -> None:
    """The tables of the transfer workload: accounts and orders."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                f'CREATE TABLE "{schema}".accounts (id text PRIMARY KEY, balance bigint NOT NULL)'
            )
        )
        conn.execute(
            sa.text(f'CREATE TABLE "{schema}".orders (id text PRIMARY KEY, item text, qty integer)')
        )


def engine_for(services: Services) -> sa.Engine:
    return sa.create_engine(sqlalchemy_url(services.postgres_url), pool_pre_ping=True)


def balances(system: SagaSystem) -> dict[str, int]:
    """Every account's balance in the system's schema."""
    engine = engine_for(system.services)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text(f'SELECT id, balance FROM "{system.schema}".accounts'))
            return {r[0]: int(r[1]) for r in rows}
    finally:
        engine.dispose()


@contextmanager
def bank_system(
    services: Services,
    pg_schema: tuple[str, str],
    tmp: Path,
    accounts: dict[str, int],
    *,
    partitions: int = 4,
) -> Iterator[SagaSystem]:
    """A SagaSystem in ``pg_schema``'s schema with the transfer tables and ``accounts``
    (id: balance) in them, its topics created; every process stopped and the topics
    deleted after."""
    _, schema = pg_schema
    engine = engine_for(services)
    try:
        bank_schema(engine, schema)
        with engine.begin() as conn:
            conn.execute(
                sa.text(f'INSERT INTO "{schema}".accounts VALUES (:i, :b)'),
                [{"i": i, "b": b} for i, b in accounts.items()],
            )
    finally:
        engine.dispose()
    with SagaSystem(services, tmp, schema, partitions=partitions).opened() as s:
        yield s


def fresh_topics(services: Services, tag: str, partitions: int) -> Iterator[KafkaSettings]:
    """Settings with a unique ``tag``-prefixed name, its topics created; deleted after."""
    s = KafkaSettings(bootstrap=services.kafka_bootstrap, prefix=unique_name(tag))
    create_topics(s, partitions)
    yield s
    delete_topics(s, list(s.topics.all))
