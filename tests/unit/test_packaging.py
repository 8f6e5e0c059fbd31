"""Every Python package of the product is listed in pyproject.toml, so `pip install .` ships it.

The list is explicit (setuptools ``packages``): a new subpackage missing from it
installs fine in editable mode and breaks only a real install (the container
image), which no other test would notice.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _walk(directory: Path) -> list[Path]:
    """Every folder under saga/, through its symlinks to coordinator/, participants/, ..."""
    found = [directory]
    for child in sorted(directory.iterdir()):
        if child.is_dir() and child.name != "__pycache__":
            found += _walk(child)
    return found


def test_every_package_is_listed_for_setuptools() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    folders = {".".join(d.relative_to(ROOT).parts): d for d in _walk(ROOT / "saga")}
    found = {name for name, d in folders.items() if (d / "__init__.py").exists()}
    data_only = {name for name, d in folders.items() if name not in found}
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    # Folders of data files (the console's page, the schemas) are listed so setuptools
    # ships them without warning that they look like undeclared packages.
    assert listed - found == data_only, "these listed packages do not exist"


def test_the_one_import_name_ships_its_type_marker() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = config["tool"]["setuptools"]["package-data"]
    assert (ROOT / "saga" / "py.typed").exists()
    assert data["saga"] == ["py.typed"]


def test_the_installed_folders_are_the_repository_ones() -> None:
    for name in ("coordinator", "participants", "streams"):
        link = ROOT / "saga" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), name
