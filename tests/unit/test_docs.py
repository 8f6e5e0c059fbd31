"""The README stays a newcomer's page, and the manual stays true to the code.

* The README is at most 400 lines and names no commit (measurement history lives in
  CHANGELOG.md), and every figure of its performance table is on the site's
  performance page, next to the command that reproduces it.
* The reference pages generated at build time (docs/_hooks.py) cover every ``saga``
  command, every record type's schema and the variables the commands read; a marker
  the hook does not know fails.
* Every page under docs/ is in the site's navigation, and the navigation names only
  pages that exist (``mkdocs build --strict``, run by ``make test``, checks links and
  anchors as well).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from saga.streams import SCHEMA_NAMES
from tests._infra import ROOT

pytestmark = pytest.mark.unit

README = ROOT / "README.md"
DOCS = ROOT / "docs"
# A commit named in prose: 7 to 40 hex digits with at least one letter and one digit.
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("saga_docs_hooks", DOCS / "_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end >= 0 else len(text)]


def test_the_readme_is_short_and_names_no_commit() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 400, "the README is for a newcomer: move detail to docs/"
    commits = COMMIT.findall(text)
    assert not commits, f"the README names commits {commits}: history goes to CHANGELOG.md"


def test_the_readme_keeps_the_ci_commands_and_the_one_line_client() -> None:
    text = README.read_text(encoding="utf-8")
    assert "make test" in text and "make chaos-short" in text
    assert "from saga import SagaClient, Step" in text
    assert 'SagaClient("127.0.0.1:19092")' in text


def test_every_readme_figure_is_on_the_performance_page() -> None:
    table = _section(README.read_text(encoding="utf-8"), "## How fast")
    page = (DOCS / "performance.md").read_text(encoding="utf-8")
    figures = re.findall(r"\d[\d,]*(?:\.\d+)?", table.split("|---", 1)[1])
    assert len(figures) >= 8, "the README's performance table lost its figures"
    missing = [f for f in figures if f not in page]
    assert not missing, f"README figures not on docs/performance.md: {missing}"
    assert "make bench" in page and "saga bench --layout pg-wallet" in page


def test_the_generated_cli_reference_has_every_command() -> None:
    hooks = _hooks()
    text = hooks.cli_reference()
    for path, _command in hooks._commands(hooks._main(), ()):
        assert f"### saga {' '.join(path)}\n" in text, path
    for name in ("submit", "coordinator run", "participant run", "reconcile", "demo"):
        assert f"### saga {name}\n" in text
    assert "Usage: saga participant run [OPTIONS]" in text


def test_the_generated_references_have_every_schema_and_variable() -> None:
    hooks = _hooks()
    schemas = hooks.schemas_reference()
    for name in SCHEMA_NAMES:
        assert f"### `{name}`" in schemas
    variables = hooks.env_reference()
    for name in ("SAGA_KAFKA_BOOTSTRAP", "SAGA_TOPIC_PREFIX", "SAGA_KEYS_DIR", "SAGA_WORKER_ID"):
        assert f"`{name}`" in variables


def test_an_unknown_marker_fails_the_build() -> None:
    hooks = _hooks()

    class Page:
        class file:  # the shape of mkdocs' Page.file
            src_path = "x.md"

    assert "Usage: saga" in hooks.on_page_markdown("<!-- generated: cli -->", Page, None, None)
    with pytest.raises(ValueError, match="unknown generated block"):
        hooks.on_page_markdown("<!-- generated: nothing -->", Page, None, None)


def _nav_pages(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def test_every_page_is_in_the_navigation_and_every_entry_exists() -> None:
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.BaseLoader)
    listed = set(_nav_pages(config["nav"]))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert listed - pages == set(), "the navigation names pages that do not exist"
    assert pages - listed == set(), "pages missing from the navigation in mkdocs.yml"
    assert Path(DOCS / "_hooks.py").is_file()
