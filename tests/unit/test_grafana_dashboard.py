"""The Grafana dashboard (deploy/grafana) and the metric names it and the alert rules read.

The metric names the dashboard uses are checked against the ones the services export,
collected from the registries of a real coordinator and participant (on the in-memory
log and SQLite); ``test_helm`` checks the chart's alert rules with the same helpers.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "saga-dashboard.json"


# ---------------------------------------------------------------- the product


def product(module: str) -> ModuleType:
    """A module of the product, under its import name of the moment.

    The packages are being moved from ``coordinator``, ``participants`` and ``streams``
    to ``saga.coordinator``, ...: with ``saga/__init__.py`` present, the new names.
    """
    prefix = "saga." if (ROOT / "saga" / "__init__.py").is_file() else ""
    return importlib.import_module(prefix + module)


@pytest.fixture(scope="module")
def exported_metrics(tmp_path_factory: pytest.TempPathFactory) -> frozenset[str]:
    """Every series name the coordinator's and a participant's /metrics can show."""
    import sqlalchemy as sa

    streams = product("streams")
    testing = product("streams.testing")
    metrics = product("streams._metrics")
    service = product("coordinator._service")
    participants = product("participants")

    settings = streams.KafkaSettings(bootstrap="memory:9092", prefix="helm")
    clock = testing.ManualClock()
    log = testing.InMemoryLog(settings, clock=clock)
    log.create_topics(1)
    coordinator = service.CoordinatorService(settings, instance_id="helm", clock=clock, log=log)
    coordinator.observer.enable_metrics(metrics.new_registry())

    url = f"sqlite:///{tmp_path_factory.mktemp('helm-metrics') / 'bank.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as connection:
        connection.execute(sa.text("CREATE TABLE accounts (id TEXT PRIMARY KEY, balance INTEGER)"))
    engine.dispose()
    storage = participants.open_storage("sql", name="bank", url=url, targets=["accounts"])
    runtime = participants.ParticipantRuntime("bank", storage, settings, log=log, clock=clock)
    runtime.observer.enable_metrics(metrics.new_registry())

    names: set[str] = set()
    for registry in (coordinator.observer.registry, runtime.observer.registry):
        for family in registry.collect():
            if family.type == "counter":
                names.add(f"{family.name}_total")
            elif family.type == "histogram":
                names.update(f"{family.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
            else:
                names.add(family.name)
    assert {"saga_decisions_total", "saga_consumer_lag", "saga_ready"} <= names
    return frozenset(names)


# ---------------------------------------------------------------- PromQL

PROMQL_FUNCTIONS = frozenset(
    {
        "abs", "absent", "absent_over_time", "avg", "avg_over_time", "bottomk", "ceil",
        "changes", "clamp", "clamp_max", "clamp_min", "count", "count_over_time",
        "count_values", "delta", "deriv", "floor", "group", "histogram_quantile", "idelta",
        "increase", "irate", "label_replace", "last_over_time", "max", "max_over_time", "min",
        "min_over_time", "quantile", "quantile_over_time", "rate", "resets", "round",
        "scalar", "sort", "sort_desc", "stddev", "stdvar", "sum", "sum_over_time", "time",
        "timestamp", "topk", "vector",
    }
)  # fmt: skip
PROMQL_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on"})
PROMETHEUS_SERIES = frozenset({"up"})  # made by Prometheus itself for every target


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label names, functions and keywords out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals ($variables too)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors
    grouping = r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"
    text = re.sub(grouping, " ", text)  # label lists
    names: set[str] = set()
    for found in re.finditer(r"(?<![\w.$])[A-Za-z_:][\w:]*", text):
        word = found.group(0)
        if text[found.end() :].lstrip().startswith("("):
            assert word in PROMQL_FUNCTIONS, f"unknown PromQL function {word!r} in {expr!r}"
        elif word not in PROMQL_KEYWORDS:
            names.add(word)
    return names


@pytest.mark.unit
@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (le) (rate(saga_x{a=~"$job", b="{c}"}[$__rate_interval]))', {"saga_x"}),
        ("histogram_quantile(0.99, sum(rate(a_bucket[5m])) by (le)) > 1e3", {"a_bucket"}),
        ("absent(saga_ready{service=\"coordinator\"} == 1) or up == 0", {"saga_ready", "up"}),
        ("sum(a) / on(service) group_left(x) b unless c offset 5m", {"a", "b", "c"}),
    ],
)  # fmt: skip
def test_metric_names_finds_every_metric_and_nothing_else(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


# ---------------------------------------------------------------- the dashboard


def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def dashboard_expressions(data: dict[str, Any]) -> list[str]:
    """Every PromQL expression: the panels' targets and the variables' queries."""
    exprs = [t["expr"] for p in data["panels"] for t in p["targets"]]
    for variable in data.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]
        query = query.get("query", "") if isinstance(query, dict) else query
        found = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
        assert found, f"variable {variable['name']}: expected label_values(SELECTOR, LABEL)"
        exprs.append(found.group(1))
    return exprs


@pytest.mark.unit
def test_the_dashboard_loads_and_every_panel_has_a_title_type_and_queries() -> None:
    data = dashboard()
    assert data["title"] and data["uid"]
    panels = data["panels"]
    assert panels
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    for panel in panels:
        assert panel.get("title"), panel
        assert panel.get("type") in {"timeseries", "stat", "gauge", "table", "bargauge"}, panel
        targets = panel.get("targets")
        assert targets, f"panel {panel['title']!r} has no targets"
        for target in targets:
            assert target.get("expr", "").strip(), f"panel {panel['title']!r}: empty expression"
            assert target.get("refId"), f"panel {panel['title']!r}: a target without refId"
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
    titles = " | ".join(p["title"].lower() for p in panels)
    for subject in ("throughput", "latency", "dlq", "lag", "participants up"):
        assert subject in titles, f"no panel about {subject}"


@pytest.mark.unit
def test_every_metric_on_the_dashboard_is_one_the_services_export(
    exported_metrics: frozenset[str],
) -> None:
    used: set[str] = set()
    for expr in dashboard_expressions(dashboard()):
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        unknown = names - exported_metrics
        assert not unknown, f"{expr!r} reads {sorted(unknown)}, which saga does not export"
        used |= names
    # The headline subjects are all there.
    assert {
        "saga_decisions_total",
        "saga_decision_latency_seconds_bucket",
        "saga_dlq_records_total",
        "saga_consumer_lag",
        "saga_ready",
    } <= used
