"""The core imports no storage driver and no Spark; drivers, Spark and the tools are extras.

``coordinator/`` (the state machine, the service, the client and the command
line) must not import SQLAlchemy, psycopg, pymongo, redis or pyspark: the
participants own the drivers and import them when a participant runs, the
reconciliation job imports pyspark when ``saga reconcile`` runs, the tools package
(:mod:`saga.tools`) its drivers when ``saga demo`` or ``saga bench`` runs. Checked
twice: in the source (every import statement of every module, and the client's
modules of ``streams``) and at run time (importing the client, the command line and
the participant runtime loads none of them), which is what lets ``pip install
saga-olep`` without extras work (tests/integration/test_client_install.py). Without
the extra a command needs, it names the extra and exits 2: the tools for ``saga
bench`` and ``saga demo``, ``postgres``/``mongo``/``redis`` for ``saga participant
run --storage sql|mongo|redis``, ``spark`` for ``saga reconcile``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._infra import ROOT

pytestmark = pytest.mark.unit

DRIVERS = ("sqlalchemy", "psycopg", "pymongo", "redis", "pyspark")
CORE = ROOT / "coordinator"
# The modules of streams that the client and the coordinator load: everything but the
# reconciliation job (which imports pyspark lazily, and is checked at run time below).
CLIENT_STREAMS = sorted(
    p for p in (ROOT / "streams").rglob("*.py") if "reconcile" not in p.relative_to(ROOT).parts
)


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``path``, wherever it sits (lazy ones too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def _is_driver(module: str) -> bool:
    return module.split(".", maxsplit=1)[0] in DRIVERS


# The console's optional PostgreSQL view (`saga console --db postgresql://...`) is its
# own storage, not a participant's: it imports psycopg lazily, behind the postgres extra,
# and says which extra to install when it is missing. Nothing else in coordinator/ may.
_CONSOLE_STORE = ("coordinator/_console/_store.py", "psycopg")


def test_no_core_module_imports_a_storage_driver() -> None:
    modules = sorted(CORE.rglob("*.py"))
    assert modules, f"no modules under {CORE}"
    offending = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in modules
        for line, module in _imported_modules(path)
        if _is_driver(module)
        and (str(path.relative_to(ROOT)), module.split(".", maxsplit=1)[0]) != _CONSOLE_STORE
    ]
    assert not offending, "coordinator/ imports a storage driver:\n" + "\n".join(offending)


def test_no_client_module_of_streams_imports_a_driver_or_spark() -> None:
    assert CLIENT_STREAMS, "no modules under streams/"
    offending = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in CLIENT_STREAMS
        for line, module in _imported_modules(path)
        if _is_driver(module)
    ]
    assert not offending, "streams/ imports a driver or pyspark:\n" + "\n".join(offending)


def test_the_static_check_sees_lazy_and_dynamic_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        textwrap.dedent(
            """
            import json
            from redis.client import Redis
            def f():
                import sqlalchemy as sa
                return importlib.import_module("pymongo")
            from . import sibling
            """
        )
    )
    drivers = [module for _, module in _imported_modules(sample) if _is_driver(module)]
    assert drivers == ["redis.client", "sqlalchemy", "pymongo"]


def _run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_importing_the_core_and_its_command_line_loads_no_driver() -> None:
    code = (
        "import json, sys\n"
        "import saga, saga.coordinator.cli, saga.coordinator._client\n"
        "import saga.coordinator._cli_client\n"
        "import saga.streams, saga.streams.kafka, saga.streams.log, saga.streams.reconcile.cli\n"
        "import saga.participants, saga.participants._runtime\n"
        "from saga.coordinator import SagaClient\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = _run_python(code)
    assert done.returncode == 0, done.stderr
    loaded = [m for m in json.loads(done.stdout) if _is_driver(m)]
    assert not loaded, f"importing the client, the command line and participants loaded {loaded}"


# A subprocess where some modules cannot be imported, as on an install without them.
_BLOCKING_SAGA = """
import sys
from importlib.abc import MetaPathFinder

BLOCKED = set(sys.argv[1].split(","))

class Missing(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Missing())
sys.argv = ["saga", *sys.argv[2:]]
from saga.coordinator.cli import run
run()
"""


@pytest.mark.parametrize("command", ["bench", "demo"])
@pytest.mark.parametrize("blocked", ["saga.tools", "sqlalchemy", "pymongo,redis"])
def test_without_the_tools_the_command_says_to_install_the_extra(
    command: str, blocked: str
) -> None:
    urls = (
        *("--postgres-url", "postgresql://u@127.0.0.1:1/db"),
        *("--mongo-url", "mongodb://127.0.0.1:1/db", "--redis-url", "redis://127.0.0.1:1/0"),
    )
    done = _run_python(_BLOCKING_SAGA, blocked, command, "--bootstrap", "127.0.0.1:1", *urls)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, done.stderr
    assert "pip install 'saga-olep[tools]'" in lines[0], lines
    assert lines[0].startswith(f"saga: saga {command} needs "), lines


def test_the_tools_commands_are_listed_and_keep_their_options() -> None:
    listed = _run_python("from saga.coordinator.cli import run; run()", "--help")
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.startswith("  ")]
    assert {"bench", "demo", "submit", "reconcile", "coordinator"} <= set(names), names
    bench = _run_python("from saga.coordinator.cli import run; run()", "bench", "--help")
    assert bench.returncode == 0, bench.stderr
    for option in ("--phases", "--rate", "--window", "--service-pid", "--redis-url"):
        assert option in bench.stdout, (option, bench.stdout)


def _one_sentence(done: subprocess.CompletedProcess[str], starts: str, *fragments: str) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(starts), lines
    for fragment in fragments:
        assert fragment in lines[0], lines
    return lines[0]


@pytest.mark.parametrize(
    ("storage", "url", "blocked", "extra"),
    [
        ("sql", "postgresql://u@127.0.0.1:1/db", "sqlalchemy", "postgres"),
        ("sql", "postgresql://u@127.0.0.1:1/db", "psycopg", "postgres"),
        ("sql", "sqlite:///nowhere.db", "sqlalchemy", "postgres"),
        ("mongo", "mongodb://127.0.0.1:1/db", "pymongo", "mongo"),
        ("redis", "redis://127.0.0.1:1/0", "redis", "redis"),
    ],
)
def test_a_participant_without_its_driver_names_the_extra(
    storage: str, url: str, blocked: str, extra: str
) -> None:
    done = _run_python(
        _BLOCKING_SAGA,
        blocked,
        *("participant", "run", "--bootstrap", "127.0.0.1:1", "--name", "p"),
        *("--storage", storage, "--url", url, "--targets", "t"),
    )
    _one_sentence(
        done,
        f"saga: the {storage} storage needs the {extra} extra",
        f"{blocked} is not installed",
        f"pip install 'saga-olep[{extra}]'",
    )


def test_sqlite_needs_no_postgres_driver() -> None:
    """psycopg is PostgreSQL's: a participant on SQLite gets past the driver check
    (and stops later, at Kafka, which is not there)."""
    done = _run_python(
        _BLOCKING_SAGA,
        "psycopg",
        *("participant", "run", "--bootstrap", "127.0.0.1:1", "--connect-timeout", "1"),
        *("--name", "p", "--storage", "sql", "--url", "sqlite://", "--targets", "t"),
    )
    assert "extra" not in done.stderr, done.stderr
    assert "does not answer" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("blocked", "ledger"),
    [
        ("pyspark", None),
        ("pymongo", "mongo:mongodb://127.0.0.1:1/db"),
        ("redis", "redis:redis://127.0.0.1:1/0"),
        ("psycopg", "sql:postgresql://u@127.0.0.1:1/db"),
    ],
)
def test_reconcile_without_spark_names_the_extra(blocked: str, ledger: str | None) -> None:
    args = ["--ledger", ledger] if ledger else []
    done = _run_python(_BLOCKING_SAGA, blocked, "reconcile", "--bootstrap", "127.0.0.1:1", *args)
    _one_sentence(
        done,
        "saga reconcile: the audit needs the spark extra",
        f"{blocked} is not installed",
        "pip install 'saga-olep[spark]'",
    )
