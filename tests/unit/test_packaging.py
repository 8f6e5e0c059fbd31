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
TOP_LEVEL = ("coordinator", "participants", "streams", "sagatools")


def test_every_package_is_listed_for_setuptools() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in TOP_LEVEL
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - found == set(), "these listed packages do not exist"


def test_every_package_ships_its_type_marker() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = config["tool"]["setuptools"]["package-data"]
    for top in TOP_LEVEL:
        assert (ROOT / top / "py.typed").exists()
        assert "py.typed" in data[top]
