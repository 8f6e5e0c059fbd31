"""The command line a newcomer meets in the first hour.

* ``saga --version`` prints the installed package's version;
* ``-v`` works after the subcommand as before it, on every command;
* ``saga submit --wait`` and ``saga status`` share one exit-status table (the real
  commands are run against Kafka in tests/e2e/test_cli_outcomes.py);
* ``saga topics delete`` never deletes without a confirmation;
* a coordinator without ``--instance-id`` takes the host name (distinct per container);
* ``saga demo`` ends with the ``saga reconcile`` command for its own prefix, and the
  README and the audit guide (docs/how-to/audit.md) show that very command.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Iterator

import click
import pytest
from click.testing import CliRunner

from saga.coordinator import cli
from saga.coordinator._cli_client import exit_code_of
from saga.streams import KafkaSettings, SagaState
from tests._infra import ROOT

pytestmark = pytest.mark.unit


def _commands(
    group: click.Group, ctx: click.Context, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, name
        if isinstance(command, click.Group):
            yield from _commands(command, ctx, (*path, name))
        else:
            yield (*path, name), command


def test_version_is_the_installed_package_version() -> None:
    done = CliRunner().invoke(cli.main, ["--version"])
    assert done.exit_code == 0, done.output
    assert done.output.strip() == f"saga, version {importlib.metadata.version('saga-olep')}"


def test_every_command_accepts_verbose_after_its_name() -> None:
    with click.Context(cli.main) as ctx:
        found = dict(_commands(cli.main, ctx))
    assert {("submit",), ("coordinator", "run"), ("topics", "delete")} <= set(found), found
    for path, command in found.items():
        opts = {opt for param in command.params for opt in param.opts}
        assert "-v" in opts, f"saga {' '.join(path)} does not accept -v"
        shown = CliRunner().invoke(cli.main, [*path, "--help"])
        assert shown.exit_code == 0, (path, shown.output)
        assert "-v, --verbose" in shown.output, (path, shown.output)


_LEVEL_AFTER = """
import logging, sys
from saga.coordinator.cli import run
sys.argv = ["saga", *sys.argv[1:]]
try:
    run()
except SystemExit:
    pass
print(logging.getLogger().level, file=sys.stderr)
"""


@pytest.mark.parametrize(
    ("args", "level"),
    [
        (["schema"], "30"),
        (["-v", "schema"], "20"),
        (["schema", "-v"], "20"),
        (["schema", "-vv"], "10"),
        (["-v", "schema", "-v"], "10"),
    ],
)
def test_verbose_after_the_subcommand_lowers_the_log_level(args: list[str], level: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _LEVEL_AFTER, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert done.stderr.strip().splitlines()[-1] == level, (args, done.stderr)


def test_one_exit_status_table_for_submit_wait_and_status() -> None:
    assert {state: exit_code_of(state) for state in SagaState} == {
        SagaState.COMMITTED: 0,
        SagaState.ROLLED_BACK: 3,
        SagaState.PENDING: 4,
        SagaState.COMMITTING: 4,
        SagaState.ROLLING_BACK: 4,
        SagaState.FAILED: 5,
    }
    page = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    for code, word in ((0, "`committed`"), (3, "`rolled_back`"), (5, "`failed`")):
        assert f"| {code} | {word}" in page, f"the CLI reference's exit-status table lacks {code}"
    assert "| 4 | not final yet" in page


def test_topics_delete_without_yes_from_a_script_deletes_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "topics", "delete", "--bootstrap", "127.0.0.1:1"],
        stdin=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if not k.startswith("SAGA_")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("saga: nothing deleted: confirm the deletion of saga.requests"), (
        lines
    )
    assert lines[0].endswith("with --yes"), lines


@pytest.mark.parametrize(
    ("hostname", "expected"),
    [("3f2a9c1b7d4e", "3f2a9c1b7d4e"), ("node-1.example", "node-1.example"), ("a b/c", "abc")],
)
def test_the_default_instance_id_is_the_host_name(
    monkeypatch: pytest.MonkeyPatch, hostname: str, expected: str
) -> None:
    monkeypatch.setattr(cli.socket, "gethostname", lambda: hostname)
    assert cli.default_instance_id() == expected


def test_the_instance_id_comes_from_the_environment_first() -> None:
    option = next(p for p in cli.coordinator_run.params if "--instance-id" in p.opts)
    assert option.envvar == "SAGA_INSTANCE_ID"
    assert option.default is None  # then default_instance_id()


# ---------------------------------------------------------------- the demo's last lines


def _demo_config(bootstrap: str = "127.0.0.1:19092") -> object:
    from saga.tools.demo import DemoConfig

    return DemoConfig(
        KafkaSettings(bootstrap=bootstrap, prefix="demo-1764000000"),
        "postgresql://saga:Sekr3t@127.0.0.1:15432/saga",
        "mongodb://127.0.0.1:27027/",
        "redis://:Sekr3t@127.0.0.1:16379/0",
    )


def test_the_demo_prints_a_reconcile_command_for_its_prefix_without_passwords() -> None:
    from saga.tools.demo import DemoConfig, reconcile_command

    cfg = _demo_config()
    assert isinstance(cfg, DemoConfig)
    same = reconcile_command(cfg, {"SAGA_KAFKA_BOOTSTRAP": "127.0.0.1:19092"})
    assert "--prefix demo-1764000000" in same
    assert "--bootstrap" not in same
    assert "Sekr3t" not in same
    assert "'sql:$SAGA_POSTGRES_URL#schema=saga_demo'" in same
    other = reconcile_command(cfg, {})
    assert "--bootstrap 127.0.0.1:19092" in other


def test_the_readme_shows_the_command_the_demo_prints() -> None:
    from saga.tools.demo import DemoConfig, reconcile_command

    cfg = _demo_config()
    assert isinstance(cfg, DemoConfig)
    command = reconcile_command(cfg, {"SAGA_KAFKA_BOOTSTRAP": cfg.kafka.bootstrap})
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    guide = (ROOT / "docs" / "how-to" / "audit.md").read_text(encoding="utf-8")
    # In the demo's sample output, and (two-space indent) in the audit guide.
    assert command in readme, command
    assert command.replace("\n    ", "\n  ") in guide, command
