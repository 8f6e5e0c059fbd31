"""Bad command-line input gets one sentence and exit code 2, never a traceback or a password.

Every case runs the real entry point (``coordinator.cli.run``, what the ``saga``
script calls) in click's isolation, with an unreachable Kafka address: the input
must be refused before anything connects.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import psycopg
import pytest
from click.testing import CliRunner
from sqlalchemy import exc as sa_exc

from saga.coordinator._client import build_request
from saga.coordinator.cli import run
from saga.participants.sql._adapter import SqlStorage
from saga.streams import ConfigurationError, InvalidRecord
from saga.streams._secrets import forget_all

pytestmark = pytest.mark.unit

NOWHERE = {"SAGA_KAFKA_BOOTSTRAP": "127.0.0.1:1", "SAGA_STORAGE_URL": None, "SAGA_KEYS_DIR": None}
STEP = '{"participant": "ledger", "action": "insert", "args": {"table": "t", "key": 1}}'


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def saga(
    *args: str, stdin: bytes | None = None, env: dict[str, str | None] | None = None
) -> Outcome:
    """Run ``saga ARGS`` through the entry point; an escaping exception becomes a traceback
    in stderr (which every test asserts is absent)."""
    runner = CliRunner()
    with (
        runner.isolation(input=stdin, env={**NOWHERE, **(env or {})}) as (out, err, _),
        mock.patch.object(sys, "argv", ["saga", *args]),
    ):
        code: int = 0
        try:
            run()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except Exception:
            sys.stderr.write(traceback.format_exc())
            code = -1
        sys.stdout.flush()
        sys.stderr.flush()
        return Outcome(code, out.getvalue().decode(), err.getvalue().decode())


@pytest.fixture(autouse=True)
def _fresh_secrets() -> Iterator[None]:
    forget_all()
    yield
    forget_all()


def one_sentence(outcome: Outcome, *expected: str) -> str:
    """The outcome is exit 2 with one ``saga: ...`` line holding every expected fragment."""
    assert "Traceback" not in outcome.stderr, outcome.stderr
    assert outcome.code == 2, outcome
    assert len(outcome.lines) == 1, outcome.stderr
    line = outcome.lines[0]
    assert line.startswith("saga: "), line
    for fragment in expected:
        assert fragment in line, line
    return line


def submission(tmp_path: Path, body: str | bytes) -> str:
    path = tmp_path / "saga.json"
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    return str(path)


# ---------------------------------------------------------------- saga submit


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ('"timeout_s": "abc"', 'timeout_s must be a number of seconds such as 30, not "abc"'),
        ('"timeout_s": null', "timeout_s must be a number of seconds such as 30, not null"),
        ('"timeout_s": true', "timeout_s must be a number of seconds such as 30, not true"),
        ('"timeout_s": -5', "timeout_s must be a positive number of seconds"),
        ('"timeout_s": 1e400', "holds 1e400, which is too large for a 64-bit number"),
        ('"timeout_s": NaN', "holds NaN, which is not JSON"),
        ('"timeout_s": Infinity', "holds Infinity, which is not JSON"),
        ('"meta": [1, 2]', "meta must be an object of names to values"),
        ('"meta": "trace"', "meta must be an object of names to values"),
        ('"mode": ["parallel"]', "mode must be 'parallel' or 'sequential'"),
        ('"tx_id": 7', "tx_id must be string"),
    ],
)
def test_submit_refuses_bad_fields(tmp_path: Path, extra: str, expected: str) -> None:
    path = submission(tmp_path, f'{{"steps": [{STEP}], {extra}}}')
    line = one_sentence(saga("submit", path), expected)
    assert line.startswith(f"saga: {path}"), line


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1", "abc", "1e400"])
def test_submit_timeout_option_must_be_positive_finite_seconds(tmp_path: Path, value: str) -> None:
    path = submission(tmp_path, f'{{"steps": [{STEP}]}}')
    outcome = saga("submit", "--timeout", value, path)
    assert "Traceback" not in outcome.stderr
    assert outcome.code == 2, outcome
    assert (
        f"Error: Invalid value for '--timeout': {value!r} is not a positive number of seconds"
        in outcome.stderr
    )


def test_submit_refuses_a_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = submission(tmp_path, b'{"steps": [], "saga": "caf\xe9"}')
    one_sentence(saga("submit", path), f"{path} is not UTF-8 text", "save the submission as UTF-8")


def test_submit_refuses_stdin_that_is_not_utf8() -> None:
    one_sentence(
        saga("submit", "-", stdin=b'{"steps": [], "saga": "\xff"}'),
        "standard input is not UTF-8 text",
    )


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("{", "is not valid JSON"),
        ("[]", "must hold an object with a 'steps' list"),
        ('{"steps": {}}', "must hold an object with a 'steps' list"),
        ('{"steps": [1]}', "a step must be an object with 'participant', 'action' and 'args'"),
        ('{"steps": []}', "steps must contain at least 1 items"),
    ],
)
def test_submit_refuses_bad_documents(tmp_path: Path, body: str, expected: str) -> None:
    one_sentence(saga("submit", submission(tmp_path, body)), expected)


def test_submit_names_a_missing_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.json")
    one_sentence(saga("submit", missing), f"cannot read {missing}: No such file or directory")


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"timeout": float("nan")}, "timeout must be a positive finite number of seconds"),
        ({"timeout": float("inf")}, "timeout must be a positive finite number of seconds"),
        ({"timeout": "abc"}, "timeout must be a number of seconds, got str 'abc'"),
        ({"timeout": None}, "timeout must be a number of seconds, got NoneType None"),
        ({"timeout": 1e300}, "timeout must be at most 1,000,000,000 seconds"),
        ({"meta": [1]}, "meta must be an object of names to values (or absent), got list"),
    ],
)
def test_the_client_library_refuses_the_same_values(
    kwargs: dict[str, object], expected: str
) -> None:
    steps = [{"participant": "ledger", "action": "insert", "args": {}}]
    with pytest.raises(InvalidRecord) as caught:
        build_request(steps, **kwargs)  # type: ignore[arg-type]
    assert expected in str(caught.value)


# ---------------------------------------------------------------- saga participant run

BAD_PORTS = [
    ("sql", "postgresql://saga:TopSecretPW@127.0.0.1:notaport/saga", "TopSecretPW"),
    ("mongo", "mongodb://user:MongoPW@127.0.0.1:notaport/", "MongoPW"),
    ("redis", "redis://:RedisPW@127.0.0.1:notaport/0", "RedisPW"),
]


@pytest.mark.parametrize(("kind", "url", "password"), BAD_PORTS)
def test_a_bad_storage_url_is_one_sentence_without_its_password(
    kind: str, url: str, password: str
) -> None:
    outcome = saga(
        "participant", "run", "--name", "p", "--storage", kind, "--targets", "t",
        env={"SAGA_STORAGE_URL": url},
    )  # fmt: skip
    shown = url.replace(password, "***")
    line = one_sentence(outcome, f"{shown!r} is not a")
    assert password not in outcome.stderr + outcome.stdout
    assert "notaport" in line


@pytest.mark.parametrize(("kind", "url", "password"), BAD_PORTS)
def test_a_password_on_the_command_line_is_redacted_and_warned_about(
    kind: str, url: str, password: str, caplog: pytest.LogCaptureFixture
) -> None:
    outcome = saga(
        "participant", "run", "--name", "p", "--storage", kind, "--targets", "t", "--url", url
    )  # fmt: skip
    one_sentence(outcome, f"{url.replace(password, '***')!r} is not a")
    assert password not in outcome.stderr + outcome.stdout + caplog.text
    assert "the storage password is on the command line" in caplog.text


def test_the_url_file_and_password_file_keep_the_password_off_the_command_line(
    tmp_path: Path,
) -> None:
    url_file = tmp_path / "url"
    url_file.write_text("postgresql://saga@127.0.0.1:notaport/saga\n", encoding="utf-8")
    pw_file = tmp_path / "pw"
    pw_file.write_text("FileSecretPW\n", encoding="utf-8")
    outcome = saga(
        "participant", "run", "--name", "p", "--storage", "sql", "--targets", "t",
        "--url-file", str(url_file), "--password-file", str(pw_file),
    )  # fmt: skip
    one_sentence(outcome, "'postgresql://saga:***@127.0.0.1:notaport/saga' is not a database URL")
    assert "FileSecretPW" not in outcome.stderr
    assert "on the command line" not in outcome.stderr


def test_participant_without_a_url_says_where_to_give_one() -> None:
    outcome = saga("participant", "run", "--name", "p", "--storage", "sql", "--targets", "t")
    one_sentence(outcome, "no storage URL", "SAGA_STORAGE_URL")


def test_participant_url_given_twice_is_refused(tmp_path: Path) -> None:
    outcome = saga(
        "participant", "run", "--name", "p", "--storage", "sql", "--targets", "t",
        "--url", "sqlite:///x.db", "--url-env", "SAGA_POSTGRES_URL",
    )  # fmt: skip
    one_sentence(outcome, "give the storage URL once: --url and --url-env were both given")


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-3"])
def test_connect_timeout_must_be_positive_finite_seconds(value: str) -> None:
    outcome = saga(
        "participant", "run", "--name", "p", "--storage", "sql", "--targets", "t",
        "--url", "sqlite:///x.db", "--connect-timeout", value,
    )  # fmt: skip
    assert "Traceback" not in outcome.stderr
    assert outcome.code == 2
    assert "Invalid value for '--connect-timeout'" in outcome.stderr


# ---------------------------------------------------------------- Kafka settings' secrets


@pytest.mark.parametrize(
    "misplaced",
    ["sasl.mechanism=KafkaSecret123", "security.protocol=KafkaSecret123"],
)
def test_kafka_errors_never_show_the_sasl_password(tmp_path: Path, misplaced: str) -> None:
    # librdkafka echoes a bad value; when the password landed in the wrong line, the
    # echo must still not show it.
    config = tmp_path / "kafka.properties"
    config.write_text(
        f"security.protocol=SASL_PLAINTEXT\nsasl.username=alice\n{misplaced}\n"
        "sasl.password=KafkaSecret123\n",
        encoding="utf-8",
    )
    outcome = saga("topics", "create", "--kafka-config", str(config))
    line = one_sentence(outcome, "cannot create a Kafka admin client")
    assert "KafkaSecret123" not in outcome.stderr + outcome.stdout
    assert "***" in line


def test_kafka_password_from_the_environment_is_never_shown() -> None:
    outcome = saga(
        "topics",
        "create",
        env={
            "SAGA_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "SAGA_KAFKA_SASL_PASSWORD": "EnvKafkaSecret1",
            "SAGA_KAFKA_SASL_MECHANISM": "EnvKafkaSecret1",
        },
    )
    one_sentence(outcome, "cannot create a Kafka admin client")
    assert "EnvKafkaSecret1" not in outcome.stderr


# ---------------------------------------------------------------- storage authentication


def _operational(message: str) -> sa_exc.OperationalError:
    # What SQLAlchemy raises when psycopg cannot log in: libpq gives no SQLSTATE then.
    return sa_exc.OperationalError(None, None, psycopg.OperationalError(message))


@pytest.mark.parametrize(
    "message",
    [
        'connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  '
        'password authentication failed for user "saga"',
        'connection failed: FATAL:  no pg_hba.conf entry for host "10.0.0.1", user "saga"',
        "connection failed: fe_sendauth: no password supplied",
    ],
)
def test_postgresql_authentication_failures_are_configuration_errors(message: str) -> None:
    store = SqlStorage("p", "postgresql://saga:WrongPassword1@127.0.0.1:5432/saga", ["t"])
    with pytest.raises(ConfigurationError) as caught, store.boundary("set up its ledger"):
        raise _operational(message)
    text = str(caught.value)
    assert "authentication failure: PostgreSQL at 127.0.0.1:5432/saga refused the user 'saga'" in (
        text
    )
    assert "fix the user name or password in the storage URL" in text
    assert "retrying is safe" not in text
    assert "WrongPassword1" not in text


def test_postgresql_unreachable_is_still_transient() -> None:
    from saga.streams import TransientError

    store = SqlStorage("p", "postgresql://saga:x@127.0.0.1:5432/saga", ["t"])
    with pytest.raises(TransientError), store.boundary("run a batch"):
        raise _operational('connection failed: connection to server at "127.0.0.1" failed: refused')


# ---------------------------------------------------------------- fault hooks, wedged clients


def test_a_wedged_kafka_client_exits_the_process_after_one_sentence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from saga.coordinator import cli

    with (
        mock.patch("os._exit", side_effect=SystemExit(1)) as exit_,
        pytest.raises(SystemExit),
    ):
        cli._exit_wedged("the transactional producer's commit did not return within 60 s")
    exit_.assert_called_once_with(1)
    err = capsys.readouterr().err
    assert err == (
        "saga: the transactional producer's commit did not return within 60 s; "
        "exiting so that a restarted process takes over\n"
    )


# ---------------------------------------------------------------- keys


def test_keys_create_makes_a_folder_and_refuses_to_overwrite_without_rotate(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    made = saga("keys", "create", "--dir", str(folder), "--participants", "bank, shop")
    assert made.code == 0, made
    principals = [line.split("\t")[0] for line in made.stdout.splitlines()]
    assert principals == [
        "coordinator",
        "client",
        "operator",
        "participant-bank",
        "participant-shop",
    ]
    assert sorted(p.name for p in folder.glob("*.key")) == sorted(f"{p}.key" for p in principals)
    for path in folder.glob("*.key"):
        assert path.stat().st_mode & 0o077 == 0, path
    again = saga("keys", "create", "--dir", str(folder), "--participants", "bank")
    one_sentence(again, "already holds the private keys of coordinator, client, operator, "
                 "participant-bank", "--rotate")  # fmt: skip
    rotated = saga("keys", "create", "--dir", str(folder), "--participants", "bank", "--rotate")
    assert rotated.code == 0, rotated
    listed = saga("keys", "list", "--dir", str(folder))
    rows = [line.split("\t") for line in listed.stdout.splitlines()]
    assert len(rows) == 9  # four principals rotated: two public keys each
    assert sum(1 for row in rows if row[2] == "private key here") == 5


def test_keys_rotate_then_retire_the_old_key_but_never_the_current_one(tmp_path: Path) -> None:
    folder = str(tmp_path / "keys")
    assert saga("keys", "create", "--dir", folder).code == 0
    old = saga("keys", "list", "--dir", folder).stdout
    old_kid = next(line.split("\t")[1] for line in old.splitlines() if line.startswith("client"))
    rotated = saga("keys", "rotate", "--dir", folder, "--principal", "client")
    assert rotated.code == 0 and f"the old key {old_kid} stays valid" in rotated.stdout
    new_kid = rotated.stdout.splitlines()[0].split("\t")[1]
    one_sentence(
        saga("keys", "retire", "--dir", folder, "--kid", new_kid),
        f"{new_kid} is the current key of client",
        "rotate it first",
    )
    retired = saga("keys", "retire", "--dir", folder, "--kid", old_kid)
    assert retired.code == 0 and old_kid not in saga("keys", "list", "--dir", folder).stdout
    one_sentence(
        saga("keys", "retire", "--dir", folder, "--kid", old_kid), "there is no public key"
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["keys", "create", "--participants", "a.b"], "'participant-a.b' is not a principal"),
        (["keys", "rotate", "--principal", "root"], "'root' is not a principal"),
        (["keys", "retire", "--kid", "../x"], "'../x' is not a key id"),
    ],
)
def test_keys_commands_refuse_bad_names(tmp_path: Path, args: list[str], expected: str) -> None:
    one_sentence(saga(*args, "--dir", str(tmp_path / "keys")), expected)


def test_keys_list_of_a_missing_folder_is_one_sentence(tmp_path: Path) -> None:
    one_sentence(saga("keys", "list", "--dir", str(tmp_path / "none")), "does not exist")


@pytest.mark.parametrize(
    "args",
    [
        ["coordinator", "run"],
        ["participant", "run", "--name", "bank", "--storage", "sql", "--targets", "t",
         "--url", "sqlite:///x.db"],
        ["submit", "-"],
        ["status", "tx-1"],
        ["watch", "--once"],
        ["abort", "tx-1"],
    ],
)  # fmt: skip
def test_a_missing_key_folder_is_one_sentence_before_connecting(
    tmp_path: Path, args: list[str]
) -> None:
    missing = str(tmp_path / "nowhere")
    stdin = f'{{"steps": [{STEP}]}}'.encode()
    for outcome in (
        saga(*args, "--keys-dir", missing, stdin=stdin),
        saga(*args, stdin=stdin, env={"SAGA_KEYS_DIR": missing}),
    ):
        one_sentence(outcome, f"the key folder {missing} does not exist", "saga keys create")


@pytest.mark.parametrize(
    ("args", "principal"),
    [
        (["coordinator", "run"], "coordinator"),
        (["participant", "run", "--name", "bank", "--storage", "sql", "--targets", "t",
          "--url", "sqlite:///x.db"], "participant-bank"),
        (["submit", "-"], "client"),
        (["abort", "tx-1", "--as-operator"], "operator"),
    ],
)  # fmt: skip
def test_a_key_folder_without_the_processs_private_key_is_one_sentence(
    tmp_path: Path, args: list[str], principal: str
) -> None:
    from saga.streams._signing import create_key

    folder = tmp_path / "keys"
    create_key(folder, "participant-other")
    outcome = saga(
        *args, env={"SAGA_KEYS_DIR": str(folder)}, stdin=f'{{"steps": [{STEP}]}}'.encode()
    )
    one_sentence(outcome, f"no private key for {principal} in {folder}")


def test_the_services_get_their_keyring_from_the_key_folder(tmp_path: Path) -> None:
    from saga.streams._signing import create_key

    folder = tmp_path / "keys"
    for principal in ("coordinator", "participant-bank"):
        create_key(folder, principal)
    with (
        mock.patch("saga.coordinator.cli.wait_for_broker"),
        mock.patch("saga.coordinator._service.CoordinatorService") as service,
        mock.patch("saga.participants.open_storage"),
        mock.patch("saga.participants.ParticipantRuntime") as runtime,
    ):
        signed = saga("coordinator", "run", env={"SAGA_KEYS_DIR": str(folder)})
        unsigned = saga("coordinator", "run")
        participant = saga(
            "participant", "run", "--name", "bank", "--storage", "sql", "--targets", "t",
            "--url", "sqlite:///x.db", "--keys-dir", str(folder),
        )  # fmt: skip
    assert signed.code == unsigned.code == participant.code == 0, (signed, unsigned, participant)
    (_, with_keys), (_, without) = service.call_args_list
    assert with_keys["keys"].principal == "coordinator" and with_keys["keys"].signs
    assert without["keys"] is None
    assert runtime.call_args.kwargs["keys"].principal == "participant-bank"


def test_coordinator_aborters_name_client_or_operator() -> None:
    one_sentence(
        saga("coordinator", "run", "--aborters", "client,participant-bank"),
        "--aborters must name client, operator or both",
    )
    with (
        mock.patch("saga.coordinator.cli.wait_for_broker"),
        mock.patch("saga.coordinator._service.CoordinatorService") as service,
    ):
        assert saga("coordinator", "run", "--aborters", "operator").code == 0
    assert service.call_args.kwargs["aborters"] == {"operator"}


def test_abort_refuses_a_bad_transaction_id() -> None:
    one_sentence(saga("abort", "not a tx id!"), "'not a tx id!' is not a transaction id")


def test_a_service_leaves_its_start_up_objects_out_of_garbage_collection() -> None:
    import gc

    from saga.coordinator.cli import _freeze_start_up

    try:
        _freeze_start_up()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
