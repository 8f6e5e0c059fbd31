"""streams._secrets: no password in a message or log line, whatever form it takes."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from saga.participants._open import storage_url, with_password
from saga.streams._errors import ConfigurationError
from saga.streams._secrets import (
    forget_all,
    install_log_redaction,
    is_secret_name,
    redact,
    redact_url,
    remember,
    remember_settings,
    url_password,
)

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _fresh_secrets() -> Iterator[None]:
    forget_all()
    yield
    forget_all()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "postgresql://saga:TopSecretPW@127.0.0.1/saga",
            "postgresql://saga:***@127.0.0.1/saga",
        ),
        (
            "'mongodb://user:MongoPW@127.0.0.1:notaport/' is not a MongoDB URL",
            "'mongodb://user:***@127.0.0.1:notaport/' is not a MongoDB URL",
        ),
        ("redis://:RedisPW@127.0.0.1:notaport/0", "redis://:***@127.0.0.1:notaport/0"),
        # a raw '@' in the password: everything up to the host goes
        ("postgresql://saga:p@ss@db.example/saga", "postgresql://saga:***@db.example/saga"),
        ("host=db user=saga password=libpqPW dbname=x", "host=db user=saga password=*** dbname=x"),
        ("sasl.password=KafkaPW", "sasl.password=***"),
        ("{'sasl.password': 'KafkaPW', 'acks': 'all'}", "{'sasl.password': '***', 'acks': 'all'}"),
        ('{"ssl.key.password": "KeyPW"}', '{"ssl.key.password": "***"}'),
        ("password=b'psycopgPW', host=", "password=b'***', host="),
        (
            "postgresql://h/db?password=QueryPW&sslmode=require",
            "postgresql://h/db?password=***&sslmode=require",
        ),
    ],
)
def test_redact_hides_passwords_in_urls_and_settings(text: str, expected: str) -> None:
    assert redact(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "redis://127.0.0.1:16379/0",
        "mongodb://h1:27017,h2:27018/saga",
        "sqlite:///tmp/x.db",
        'FATAL:  password authentication failed for user "saga"',
        "a wrong password: check the URL",
        "saga: participant 'ledger' could not set up its ledger",
    ],
)
def test_redact_leaves_text_without_secrets_alone(text: str) -> None:
    assert redact(text) == text


def test_a_remembered_secret_is_hidden_wherever_it_appears_also_percent_encoded() -> None:
    remember("Top Secret/PW")
    assert redact("driver said: Top Secret/PW was refused") == "driver said: *** was refused"
    assert redact("dsn user=x pass Top%20Secret%2FPW") == "dsn user=x pass ***"
    assert redact("form Top+Secret%2FPW") == "form ***"


def test_a_short_secret_is_hidden_only_in_urls_and_settings() -> None:
    # "saga" as the password must not blank out "saga" everywhere else.
    remember("saga")
    assert redact("postgresql://saga:saga@h/saga") == "postgresql://saga:***@h/saga"
    assert redact("saga: participant 'x'") == "saga: participant 'x'"


def test_url_password_reads_urls_no_driver_accepts() -> None:
    assert url_password("mongodb://user:MongoPW@127.0.0.1:notaport/") == "MongoPW"
    assert url_password("redis://:RedisPW@127.0.0.1:notaport/0") == "RedisPW"
    assert url_password("postgresql://saga:p%40ss@h/db") == "p@ss"
    assert url_password("postgresql://saga@h/db") is None
    assert url_password("redis://h:6379/0") is None
    assert url_password("not a url") is None


def test_redact_url_remembers_the_password_for_later_messages() -> None:
    assert redact_url("postgresql://saga:LongSecret1@h/db") == "postgresql://saga:***@h/db"
    assert redact("the server echoed LongSecret1") == "the server echoed ***"


def test_secret_setting_names() -> None:
    for name in ("sasl.password", "ssl.key.password", "sasl.oauthbearer.client.secret"):
        assert is_secret_name(name)
    for name in ("sasl.username", "security.protocol", "bootstrap.servers"):
        assert not is_secret_name(name)
    remember_settings({"sasl.password": "KafkaSecret123", "sasl.username": "alice-the-user"})
    assert redact("CONFWARN: `sasl.mechanism` set to `KafkaSecret123`") == (
        "CONFWARN: `sasl.mechanism` set to `***`"
    )
    assert redact("user alice-the-user") == "user alice-the-user"


def test_log_lines_and_their_tracebacks_are_redacted() -> None:
    logger = logging.getLogger("test.secrets.redaction")
    logger.propagate = False
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    try:
        install_log_redaction(logger)
        install_log_redaction(logger)  # idempotent: wrapped once
        remember("LoggedSecret9")
        logger.warning("connecting to %s", "postgresql://u:LoggedSecret9@h/db")
        try:
            raise ValueError("driver echoed LoggedSecret9")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert "LoggedSecret9" not in text
    assert "WARNING connecting to postgresql://u:***@h/db" in text
    assert "ValueError: driver echoed ***" in text


# ---------------------------------------------------------------- where the URL comes from


def test_the_url_comes_from_a_file_an_env_variable_or_saga_storage_url(
    tmp_path: Path,
) -> None:
    path = tmp_path / "url"
    path.write_text("postgresql://saga:FileSecret1@h/db\nsecond line ignored\n", encoding="utf-8")
    assert storage_url(url_file=str(path), environ={}) == "postgresql://saga:FileSecret1@h/db"
    assert redact("echo FileSecret1") == "echo ***"
    env = {"MY_DB": "redis://:EnvSecret1@h:6379/0", "SAGA_STORAGE_URL": "sqlite:///x.db"}
    assert storage_url(url_env="MY_DB", environ=env) == "redis://:EnvSecret1@h:6379/0"
    assert storage_url(environ=env) == "sqlite:///x.db"
    assert storage_url(url="sqlite:///y.db", environ=env) == "sqlite:///y.db"


def test_a_password_file_sets_the_password_percent_encoded(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("p@ss/word 1\n", encoding="utf-8")
    got = storage_url(
        url="postgresql://saga:old@db:5432/saga", password_file=str(secret), environ={}
    )
    assert got == "postgresql://saga:p%40ss%2Fword%201@db:5432/saga"
    assert url_password(got) == "p@ss/word 1"
    assert with_password("redis://h:6379/0", "RedisSecret1") == "redis://:RedisSecret1@h:6379/0"
    assert with_password("mongodb://u@h1,h2/db", "x") == "mongodb://u:x@h1,h2/db"
    with pytest.raises(ConfigurationError, match="needs a URL with a host"):
        with_password("sqlite:///file.db", "x")


@pytest.mark.parametrize(
    ("kwargs", "environ", "message"),
    [
        ({}, {}, "no storage URL: pass --url-file PATH, --url-env NAME or --url URL"),
        (
            {"url": "sqlite:///a", "url_env": "X"},
            {"X": "sqlite:///b"},
            "give the storage URL once: --url and --url-env were both given",
        ),
        ({"url_env": "NOT_SET"}, {}, "the environment variable NOT_SET (named by --url-env)"),
        ({"url_file": "/nonexistent/url"}, {}, "cannot read the storage URL from /nonexistent/url"),
    ],
)
def test_url_source_mistakes_say_what_to_do(
    kwargs: dict[str, str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        storage_url(environ=environ, **kwargs)
    assert message in str(caught.value)
