"""Every saga request the documentation shows is one `saga submit` accepts: no rot.

The requests are the JSON blocks of README.md and docs/ (every page) that hold ``steps``, and the
files of examples/. Each is read as `saga submit` reads it (only the submission's
keys), built into the wire record as `saga submit` builds it, validated against the
request schema (what `saga schema saga.request` prints), and each built-in step's
arguments are checked as a participant checks them. The README's own copy of an
example must be the file's content, and every example must be named in the README.

That they also *work* (commit, roll back) is shown with real processes in
tests/e2e/test_cli_outcomes.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

import fastjsonschema
import pytest

from saga.coordinator._client import build_request
from saga.participants._actions import is_builtin, parse_action
from saga.streams import InvalidRecord, schema, to_dict
from tests._infra import ROOT

pytestmark = pytest.mark.unit

README = ROOT / "README.md"
EXAMPLES = ROOT / "examples"
DOCS = [README, *sorted((ROOT / "docs").rglob("*.md"))]
# The keys of a submission (coordinator/_cli_client.py submit's docstring).
SUBMISSION_KEYS = frozenset({"steps", "saga", "mode", "timeout_s", "tx_id", "meta"})
JSON_BLOCK = re.compile(r"^```json\n(.*?)^```", re.MULTILINE | re.DOTALL)
VALIDATE = fastjsonschema.compile(schema("saga.request"))


def _blocks() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for i, match in enumerate(JSON_BLOCK.finditer(text)):
            found.append((f"{path.relative_to(ROOT)} json block {i + 1}", match[1]))
    return found


def _examples() -> list[tuple[str, str]]:
    return [
        (str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"))
        for p in sorted(EXAMPLES.glob("*.json"))
    ]


def check_submission(where: str, text: str) -> None:
    """Fail with ``where`` and the reason unless ``text`` is a request `saga submit` takes."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        pytest.fail(f"{where} is not JSON: {exc}")
    assert isinstance(data, dict) and isinstance(data.get("steps"), list), (
        f"{where}: not a submission (an object with a steps list)"
    )
    unknown = set(data) - SUBMISSION_KEYS
    assert not unknown, f"{where}: `saga submit` ignores the keys {sorted(unknown)}"
    try:
        request = build_request(
            data["steps"],
            saga=str(data.get("saga", "saga")),
            mode=data.get("mode", "parallel"),
            timeout=float(data.get("timeout_s", 30)),
            tx_id=data.get("tx_id"),
            meta=data.get("meta"),
        )
    except InvalidRecord as exc:
        pytest.fail(f"{where}: {exc.reason}")
    record = to_dict(request)
    try:
        VALIDATE(record)
    except fastjsonschema.JsonSchemaException as exc:
        pytest.fail(f"{where}: not valid against saga.request: {exc.message}")
    for index, step in enumerate(request.steps):
        if is_builtin(step.action):
            targets = frozenset([str(step.args.get("target"))])
            parse_action(step.action, step.args, targets)  # BusinessRejection says why
        else:
            pytest.fail(f"{where}: step {index} uses {step.action!r}, which is not built in")


def test_there_is_something_to_check() -> None:
    assert len(_examples()) >= 3, "examples/ should hold the README's requests"
    assert any("steps" in text for _, text in _blocks()), "README.md shows no request"


@pytest.mark.parametrize(("where", "text"), _examples() + _blocks(), ids=lambda v: str(v)[:40])
def test_every_request_shown_is_one_saga_submit_accepts(where: str, text: str) -> None:
    if where.endswith(".json") or '"steps"' in text:
        check_submission(where, text)


def test_the_readme_names_every_example_and_each_it_names_exists() -> None:
    readme = README.read_text(encoding="utf-8")
    named = set(re.findall(r"examples/([A-Za-z0-9_.-]+\.json)", readme))
    shipped = {p.name for p in EXAMPLES.glob("*.json")}
    assert named - shipped == set(), f"the README names examples that do not exist: {named}"
    unnamed = {n for n in shipped - named if f"`{n}`" not in readme}
    assert not unnamed, f"examples the README never mentions: {sorted(unnamed)}"


def test_the_readme_copy_of_transfer_json_is_the_file() -> None:
    readme = README.read_text(encoding="utf-8")
    at = readme.index("`examples/transfer.json`")
    block = JSON_BLOCK.search(readme, at)
    assert block is not None, "no json block after `examples/transfer.json` in the README"
    shipped = json.loads((EXAMPLES / "transfer.json").read_text(encoding="utf-8"))
    assert json.loads(block[1]) == shipped


@pytest.mark.parametrize(
    ("broken", "says"),
    [
        ({"mode": "parallell"}, "mode must be"),
        ({"timeout": 30}, "ignores the keys ['timeout']"),
        ({"steps": [{"participant": "ledger", "action": "increment", "args": {}}]}, "increment"),
        ({"steps": [{"participant": "ledger", "action": "transfer", "args": {}}]}, "not built in"),
        ({"steps": [{"participant": "", "action": "put", "args": {}}]}, "participant"),
    ],
)
def test_the_check_catches_rot(broken: dict[str, Any], says: str) -> None:
    good = json.loads((EXAMPLES / "transfer.json").read_text(encoding="utf-8"))
    with pytest.raises(BaseException) as caught:
        check_submission("broken.json", json.dumps({**good, **broken}))
    assert says in str(caught.value), caught.value
