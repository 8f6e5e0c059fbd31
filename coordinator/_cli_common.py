"""What every ``saga`` command shares: Kafka options, settings, seconds, one-sentence failures.

Imported by :mod:`coordinator.cli`, its command modules (``coordinator._cli_*``)
and the tools' commands (:mod:`saga.tools.cli`); it imports no storage driver.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from saga.streams._secrets import redact, remember_settings
from saga.streams.kafka import KafkaSettings

if TYPE_CHECKING:
    from saga.streams._faults import Faults
    from saga.streams._signing import Keyring

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_CONNECT_TIMEOUT_S = 30.0
TOOLS_HINT = "install the tools extra: pip install 'saga-olep[tools]'"
MAX_TIMEOUT_S = 1_000_000_000  # as coordinator._client.MAX_TIMEOUT_S (not imported: start-up cost)


TEST_LAUNCHER = "python -m tests.launch"
"""The test suite's entry point (tests/launch.py, never installed): the one that arms faults."""
_TEST_VARIABLES = {
    "SAGA_UNSAFE_TEST_SWITCHES": "switches a guarantee off",
    "SAGA_FAULTS": "arms crash points",
}
_test_faults: Callable[[Mapping[str, str]], Faults] | None = None


def enable_test_faults(make: Callable[[Mapping[str, str]], Faults]) -> None:
    """Let ``SAGA_FAULTS`` and ``SAGA_UNSAFE_TEST_SWITCHES`` through, made into hooks by
    ``make`` (:func:`streams._faults.faults_from_env`). Called only by the test suite's
    launcher: the ``saga`` command as installed refuses both (:func:`refuse_test_switches`).
    """
    global _test_faults  # noqa: PLW0603  (one per process, set before the command runs)
    _test_faults = make


def refuse_test_switches(environ: Mapping[str, str]) -> None:
    """Exit with one sentence (code 2) if a test-only variable is set, unless the test
    suite's launcher enabled them; under the launcher, warn about unsafe switches."""
    if _test_faults is not None:
        if environ.get("SAGA_UNSAFE_TEST_SWITCHES"):
            logging.getLogger("saga").warning(
                "unsafe test switches on (%s): guarantees are broken on purpose",
                environ["SAGA_UNSAFE_TEST_SWITCHES"],
            )
        return
    for name, what in _TEST_VARIABLES.items():
        if environ.get(name):
            fail(
                f"{name} is set ({environ[name]}), but the saga command never {what}: unset "
                f"it; it is read only by the test suite's launcher ({TEST_LAUNCHER})",
                2,
            )


def process_faults() -> Faults:
    """The fault hooks of a service command: none, except under the test suite's launcher."""
    from saga.streams._faults import NO_FAULTS

    return NO_FAULTS if _test_faults is None else _test_faults(os.environ)


def fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"saga: {redact(message)}", err=True)
    sys.exit(code)


class Seconds(click.FloatRange):
    """A positive, finite number of seconds (click's FLOAT accepts nan and inf)."""

    name = "seconds"

    def __init__(self, maximum: float = MAX_TIMEOUT_S) -> None:
        super().__init__(0, maximum, min_open=True)
        self.maximum = maximum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = math.nan
        if not (math.isfinite(seconds) and 0 < seconds <= self.maximum):
            self.fail(
                f"{value!r} is not a positive number of seconds (at most {self.maximum:,.0f}); "
                "give one such as 30",
                param,
                ctx,
            )
        return seconds


def connect_timeout_option(fn: F) -> F:
    return click.option(
        "--connect-timeout",
        type=Seconds(3600),
        default=DEFAULT_CONNECT_TIMEOUT_S,
        show_default=True,
        envvar="SAGA_CONNECT_TIMEOUT",
        help="Seconds to wait at start-up for Kafka to answer before exiting with one "
        "sentence [env SAGA_CONNECT_TIMEOUT].",
    )(fn)


def _parse_retention(_ctx: click.Context, _param: click.Parameter, value: str) -> int:
    from saga.streams._duration import parse_duration_ms

    try:
        return parse_duration_ms(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--retention") from None


def retention_option(what: str) -> Callable[[F], F]:
    """``--retention`` (a duration) as ``retention_ms``; the same default everywhere."""
    from saga.streams._duration import DEFAULT_RETENTION

    return click.option(
        "--retention",
        "retention_ms",
        default=DEFAULT_RETENTION,
        show_default=True,
        callback=_parse_retention,
        help=f"{what} (90s, 30m, 12h, 7d); use one value for the coordinator and "
        "every participant.",
    )


def kafka_options(fn: F) -> F:
    fn = click.option(
        "--kafka-config",
        type=click.Path(dir_okay=False),
        default=None,
        help="File of key=value Kafka client settings (security.protocol, sasl.*, ssl.*).",
    )(fn)
    fn = click.option(
        "--prefix", default=None, help="Topic prefix [env SAGA_TOPIC_PREFIX; default: saga]."
    )(fn)
    fn = click.option(
        "--bootstrap", default=None, help="Kafka bootstrap servers [env SAGA_KAFKA_BOOTSTRAP]."
    )(fn)
    return fn


def settings_from(
    bootstrap: str | None, prefix: str | None, kafka_config: str | None
) -> KafkaSettings:
    settings = KafkaSettings.from_sources(bootstrap, prefix, kafka_config, os.environ)
    # sasl.password, ssl.key.password, ...: never shown by a message or log line.
    remember_settings(settings.extra)
    return settings


def keys_dir_option(fn: F) -> F:
    """``--keys-dir`` [env SAGA_KEYS_DIR]: the key folder that turns signing on."""
    return click.option(
        "--keys-dir",
        type=click.Path(file_okay=False),
        default=None,
        envvar="SAGA_KEYS_DIR",
        help="Key folder (made by `saga keys create`): sign what this process writes and "
        "verify what it acts on [env SAGA_KEYS_DIR; default: records are not authenticated].",
    )(fn)


def load_keys(keys_dir: str | None, principal: str | None) -> Keyring | None:
    """The keyring of ``principal`` from ``keys_dir`` (None: no key folder, no signing).

    ``principal=None`` loads the public keys only (a process that only verifies). A
    missing folder or private key: one sentence, exit 2.
    """
    if not keys_dir:
        return None
    from saga.streams._errors import ConfigurationError
    from saga.streams._signing import Keyring

    try:
        return Keyring.load(keys_dir, principal)
    except ConfigurationError as exc:
        fail(str(exc), 2)
