"""Test-only switches stay in the test suite (issue 31, item 6).

The ``saga`` command as installed refuses ``SAGA_UNSAFE_TEST_SWITCHES`` and
``SAGA_FAULTS`` with one sentence (exit 2), before it connects to anything; only the
test suite's launcher (``python -m tests.launch``, :mod:`tests.launch`) reads them and
gives the services their fault hooks. The cases run the real entry point as
:mod:`tests.unit.test_cli_inputs` does.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from unittest import mock

import pytest

from tests.unit.test_cli_inputs import one_sentence, saga

pytestmark = pytest.mark.unit


@pytest.fixture
def test_launcher() -> Iterator[None]:
    """Run the command as ``python -m tests.launch`` does: test-only variables read."""
    from saga.coordinator import _cli_common
    from saga.streams._faults import faults_from_env

    _cli_common.enable_test_faults(faults_from_env)
    try:
        yield
    finally:
        _cli_common._test_faults = None


@pytest.mark.parametrize(
    ("name", "value", "what"),
    [
        ("SAGA_UNSAFE_TEST_SWITCHES", "barrier-off", "never switches a guarantee off"),
        ("SAGA_UNSAFE_TEST_SWITCHES", "auto-commit", "never switches a guarantee off"),
        ("SAGA_FAULTS", "coordinator.after_read:3", "never arms crash points"),
    ],
)
@pytest.mark.parametrize("command", [("coordinator", "run"), ("participants",)])
def test_the_saga_command_refuses_the_test_only_variables(
    name: str, value: str, what: str, command: tuple[str, ...]
) -> None:
    with (
        mock.patch("saga.coordinator.cli.wait_for_broker") as waited,
        mock.patch("saga.coordinator._service.CoordinatorService") as service,
    ):
        outcome = saga(*command, env={name: value})
    one_sentence(outcome, f"{name} is set ({value})", what, "unset it", "python -m tests.launch")
    assert not waited.called and not service.called


def test_coordinator_run_gives_the_service_its_faults_and_a_log_that_exits_when_wedged(
    test_launcher: None,
) -> None:
    from saga.coordinator import cli
    from saga.streams._faults import NO_FAULTS, KillFaults
    from saga.streams.log import KafkaLog

    with (
        mock.patch("saga.coordinator.cli.wait_for_broker"),
        mock.patch("saga.coordinator._service.CoordinatorService") as service,
    ):
        plain = saga("coordinator", "run")
        armed = saga("coordinator", "run", env={"SAGA_FAULTS": "coordinator.after_read:3"})
    assert plain.code == 0 and armed.code == 0, (plain, armed)
    (_, first), (_, second) = service.call_args_list
    assert first["faults"] is NO_FAULTS
    assert isinstance(second["faults"], KillFaults)
    log = first["log"]
    assert isinstance(log, KafkaLog)
    assert log._on_wedged is cli._exit_wedged


def test_participant_run_gives_runtime_and_storage_the_same_faults(
    test_launcher: None, caplog: pytest.LogCaptureFixture
) -> None:
    from saga.coordinator import cli
    from saga.streams._faults import KillFaults
    from saga.streams.log import KafkaLog

    with (
        mock.patch("saga.coordinator.cli.wait_for_broker"),
        mock.patch("saga.participants.open_storage") as open_storage,
        mock.patch("saga.participants.ParticipantRuntime") as runtime,
    ):
        outcome = saga(
            "participant", "run", "--name", "p", "--storage", "sql", "--targets", "t",
            "--url", "sqlite:///x.db",
            env={"SAGA_FAULTS": "participant.after_events:2",
                 "SAGA_UNSAFE_TEST_SWITCHES": "barrier-off"},
        )  # fmt: skip
    assert outcome.code == 0, outcome
    assert "unsafe test switches on (barrier-off)" in caplog.text
    faults = runtime.call_args.kwargs["faults"]
    assert isinstance(faults, KillFaults) and faults.unsafe("barrier-off")
    assert open_storage.call_args.kwargs["faults"] is faults
    log = runtime.call_args.kwargs["log"]
    assert isinstance(log, KafkaLog)
    assert log._on_wedged is cli._exit_wedged


def test_a_bad_fault_point_is_one_sentence(test_launcher: None) -> None:
    outcome = saga("coordinator", "run", env={"SAGA_FAULTS": "coordinator.nowhere:1"})
    one_sentence(outcome, "unknown fault point 'coordinator.nowhere' in SAGA_FAULTS")


def test_the_test_launcher_is_the_saga_command_that_reads_the_test_variables() -> None:
    """``python -m tests.launch`` (what the crash and chaos suites start) accepts what the
    installed command refuses, and is otherwise the same command."""
    import subprocess

    from tests._infra import ROOT

    env = {"PATH": "/usr/bin:/bin", "SAGA_UNSAFE_TEST_SWITCHES": "barrier-off"}
    shipped = subprocess.run(
        [sys.executable, "-m", "coordinator", "schema"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    launched = subprocess.run(
        [sys.executable, "-m", "tests.launch", "schema"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert shipped.returncode == 2 and "SAGA_UNSAFE_TEST_SWITCHES is set" in shipped.stderr
    assert launched.returncode == 0 and "saga.request" in launched.stdout, launched.stderr
