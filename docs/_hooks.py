"""MkDocs hook: the reference pages that are generated from the code at build time.

A page holds a marker line, ``<!-- generated: NAME -->``, and this hook replaces it with
the text the code produces now, so the manual cannot drift from the product:

* ``cli``: every ``saga`` command's own ``--help`` (run through ``click.testing.CliRunner``
  on :data:`saga.coordinator.cli.main`, the tools' commands included);
* ``env``: the environment variables the commands read, taken from their options;
* ``schemas``: each record type's JSON Schema, read from ``streams/schemas/``.

The help is produced with every ``SAGA_*`` variable unset, so the page shows the
defaults and not the environment of whoever built it. An unknown marker fails the build.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- generated: ([a-z]+) -->$", re.MULTILINE)
# How an option's help names the variable it falls back to: "[env SAGA_X; default: ...]".
ENV_NAME = re.compile(r"\[env (SAGA_[A-Z0-9_]*[A-Z0-9])")
HELP_WIDTH = 100


def _main() -> click.Group:
    from saga.coordinator.cli import main

    return main


def _commands(
    group: click.Group, path: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    """Every command under ``group``, depth first, in the order ``--help`` lists them."""
    ctx = click.Context(group, info_name=" ".join(("saga", *path)))
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is None or command.hidden:
            continue
        yield (*path, name), command
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))


def _help(args: tuple[str, ...]) -> str:
    runner = CliRunner()
    unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith("SAGA_")}
    result = runner.invoke(
        _main(),
        [*args, "--help"],
        prog_name="saga",
        env=unset,
        terminal_width=HELP_WIDTH,
        max_content_width=HELP_WIDTH,
    )
    if result.exit_code != 0:
        raise RuntimeError(f"`saga {' '.join(args)} --help` failed: {result.output}")
    return result.output.rstrip()


def cli_reference() -> str:
    parts = ["### saga\n", "```text", _help(()), "```", ""]
    for path, _command in _commands(_main(), ()):
        parts += [f"### saga {' '.join(path)}\n", "```text", _help(path), "```", ""]
    return "\n".join(parts)


def env_reference() -> str:
    """A table: variable, the option it stands for, the commands that read it."""
    found: dict[str, dict[str, set[str]]] = {}
    for path, command in _commands(_main(), ()):
        if isinstance(command, click.Group):
            continue
        for param in command.params:
            if not isinstance(param, click.Option):
                continue
            names = set(ENV_NAME.findall(param.help or ""))
            envvar: Any = param.envvar
            if isinstance(envvar, str):
                names.add(envvar)
            elif envvar:
                names.update(envvar)
            for name in names:
                entry = found.setdefault(name, {"options": set(), "commands": set()})
                entry["options"].add(max(param.opts, key=len))
                entry["commands"].add("saga " + " ".join(path))
    rows = ["| variable | option | read by |", "|---|---|---|"]
    for name in sorted(found):
        options = ", ".join(f"`{o}`" for o in sorted(found[name]["options"]))
        commands = sorted(found[name]["commands"])
        shown = ", ".join(f"`{c}`" for c in commands[:6])
        if len(commands) > 6:
            shown += f" and {len(commands) - 6} more"
        rows.append(f"| `{name}` | {options} | {shown} |")
    return "\n".join(rows)


def schemas_reference() -> str:
    from saga.streams import SCHEMA_NAMES

    parts: list[str] = []
    for name in SCHEMA_NAMES:
        path = ROOT / "streams" / "schemas" / f"{name}.schema.json"
        text = json.dumps(json.loads(path.read_text(encoding="utf-8")), indent=2)
        parts += [
            f"### `{name}`\n",
            f"`streams/schemas/{path.name}`:\n",
            "```json",
            text,
            "```",
            "",
        ]
    return "\n".join(parts)


GENERATORS = {"cli": cli_reference, "env": env_reference, "schemas": schemas_reference}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace each marker of a page with the text generated for it."""

    def generated(match: re.Match[str]) -> str:
        name = match[1]
        if name not in GENERATORS:
            raise ValueError(f"{page.file.src_path}: unknown generated block {name!r}")
        return GENERATORS[name]()

    return MARKER.sub(generated, markdown)
