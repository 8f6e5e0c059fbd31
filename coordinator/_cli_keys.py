"""``saga keys``: the Ed25519 keys that sign saga records (see :mod:`streams._signing`).

``create`` makes a key folder: one private key for the coordinator, the clients,
the operators and each participant, and every principal's public key. ``rotate``
gives one principal a new key pair (its old public key stays valid until
``retire`` removes it); ``list`` shows the public keys and which private keys
the folder holds. A host should get only its own private key and every public key.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from saga.coordinator._cli_common import fail

_DIR_HELP = "The key folder [env SAGA_KEYS_DIR]."


def _dir_option(fn: click.decorators.FC) -> click.decorators.FC:
    return click.option(
        "--dir",
        "directory",
        type=click.Path(file_okay=False),
        required=True,
        envvar="SAGA_KEYS_DIR",
        help=_DIR_HELP,
    )(fn)


def _current_kid(folder: Path, principal: str) -> str | None:
    """The key id of ``principal``'s private key in ``folder``, if it is there."""
    path = folder / f"{principal}.key"
    try:
        kid = json.loads(path.read_text()).get("kid")
    except (OSError, ValueError, AttributeError):
        return None
    return kid if isinstance(kid, str) else None


@click.group()
def keys() -> None:
    """Create, rotate, retire and list the keys that sign saga records."""


@keys.command("create")
@_dir_option
@click.option(
    "--participants",
    default="",
    help="Comma-separated participant names: one key each (participant-<name>).",
)
@click.option(
    "--rotate",
    is_flag=True,
    help="Replace private keys that exist (their old public keys stay valid until retired).",
)
def keys_create(directory: str, participants: str, rotate: bool) -> None:
    """Make keys for the coordinator, a client, an operator and each participant."""
    from saga.streams._errors import ConfigurationError
    from saga.streams._signing import CLIENT, COORDINATOR, OPERATOR, check_principal, create_key

    names = [p.strip() for p in participants.split(",") if p.strip()]
    principals = [COORDINATOR, CLIENT, OPERATOR, *(f"participant-{n}" for n in names)]
    try:
        for principal in principals:
            check_principal(principal)
    except ConfigurationError as exc:
        fail(str(exc), 2)
    folder = Path(directory)
    if folder.exists() and not folder.is_dir():
        fail(f"{folder} is not a folder", 2)
    existing = [p for p in principals if (folder / f"{p}.key").exists()]
    if existing and not rotate:
        fail(
            f"{folder} already holds the private keys of {', '.join(existing)}: pass --rotate "
            "to replace them (their old public keys stay valid until `saga keys retire`)",
            2,
        )
    for principal in principals:
        try:
            kid = create_key(folder, principal)
        except (ConfigurationError, OSError) as exc:
            fail(f"cannot create the key of {principal} in {folder}: {exc}", 2)
        click.echo(f"{principal}\t{kid}")


@keys.command("rotate")
@_dir_option
@click.option("--principal", required=True, help="coordinator, client, operator or participant-X.")
def keys_rotate(directory: str, principal: str) -> None:
    """Give PRINCIPAL a new key pair; its old public key stays valid until retired."""
    from saga.streams._errors import ConfigurationError
    from saga.streams._signing import create_key

    old = _current_kid(Path(directory), principal)
    try:
        kid = create_key(directory, principal)
    except (ConfigurationError, OSError) as exc:
        fail(str(exc), 2)
    click.echo(f"{principal}\t{kid}")
    if old is not None:
        click.echo(
            f"the old key {old} stays valid until `saga keys retire --kid {old}` "
            "(once every process signs with the new one)"
        )


@keys.command("retire")
@_dir_option
@click.option("--kid", required=True, help="The key id to remove (see `saga keys list`).")
def keys_retire(directory: str, kid: str) -> None:
    """Remove public key KID: records signed with it are no longer accepted."""
    from saga.streams._errors import ConfigurationError
    from saga.streams._signing import retire_key

    folder = Path(directory)
    if "/" in kid or "\\" in kid or kid.startswith("."):
        fail(f"{kid!r} is not a key id", 2)
    principal = kid.rsplit(".", 1)[0]
    if _current_kid(folder, principal) == kid:
        fail(
            f"{kid} is the current key of {principal} (its private key is in {folder}): "
            f"rotate it first with `saga keys rotate --principal {principal}`",
            2,
        )
    try:
        retire_key(folder, kid)
    except ConfigurationError as exc:
        fail(str(exc), 2)
    click.echo(f"retired {kid}")


@keys.command("list")
@_dir_option
def keys_list(directory: str) -> None:
    """The public keys of the folder: principal, key id, whether its private key is here."""
    from saga.streams._errors import ConfigurationError
    from saga.streams._signing import _read_public

    folder = Path(directory)
    if not folder.is_dir():
        fail(f"the key folder {folder} does not exist: create it with `saga keys create`", 2)
    try:
        found = [_read_public(path) for path in sorted(folder.glob("*.pub"))]
    except ConfigurationError as exc:
        fail(str(exc), 2)
    for public in sorted(found, key=lambda k: (k.principal, k.kid)):
        here = "private key here" if _current_kid(folder, public.principal) == public.kid else "-"
        click.echo(f"{public.principal}\t{public.kid}\t{here}")
