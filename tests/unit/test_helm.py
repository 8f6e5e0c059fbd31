"""The Helm chart (deploy/helm/saga); the Grafana dashboard is in ``test_grafana_dashboard``.

The chart's tests need the ``helm`` binary: ``infra/helm.sh`` builds it with ``go
install`` into ``.infra/`` the first time (a few minutes), so they skip only when there
is no Go toolchain. Each values file (the defaults and every ``ci/*-values.yaml``) is
linted and rendered, and every rendered object is validated against the Kubernetes
JSON schemas of ``kubernetes-validate`` (strict: an unknown field fails);
the Prometheus Operator objects, which those schemas lack, get structural checks. The
rendered command lines are parsed by the product's own command line, so a flag the
chart passes must exist.

The metric names the alert rules use are checked against the ones the services export
(``exported_metrics`` of ``test_grafana_dashboard``).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.test_grafana_dashboard import (  # noqa: F401 (fixture)
    PROMETHEUS_SERIES,
    exported_metrics,
    metric_names,
    product,
)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "saga"
FULL_VALUES = CHART / "ci" / "full-values.yaml"
CREATED_SECRETS_VALUES = CHART / "ci" / "created-secrets-values.yaml"
VALUES_FILES: list[Path | None] = [None, *sorted((CHART / "ci").glob("*-values.yaml"))]
NAMESPACE = "saga-test"

Manifest = dict[str, Any]

# The helm tests need the binary (integration), and the first one may build it (minutes).
NEEDS_HELM = pytest.mark.integration
BUILD_TIMEOUT = pytest.mark.timeout(1800)


def _values_id(path: Path | None) -> str:
    return "defaults" if path is None else path.name


# ---------------------------------------------------------------- helm


@pytest.fixture(scope="module")
def helm() -> str:
    """The helm binary, built by infra/helm.sh when missing (skipped only without Go)."""
    env = dict(os.environ)
    if shutil.which("go") is None and Path("/usr/local/go/bin/go").is_file():
        env["PATH"] = f"{env.get('PATH', '')}:/usr/local/go/bin"
    if shutil.which("go", path=env.get("PATH")) is None:
        pytest.skip("no Go toolchain: infra/helm.sh builds helm with go install")
    done = subprocess.run(
        [str(ROOT / "infra" / "helm.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=1700,
        check=False,
    )
    assert done.returncode == 0, f"infra/helm.sh failed:\n{done.stderr}"
    path = done.stdout.strip().splitlines()[-1]
    assert Path(path).is_file(), path
    return path


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm, *args], capture_output=True, text=True, timeout=120, check=False, cwd=ROOT
    )


def render(helm: str, values: Path | None, *extra: str) -> list[Manifest]:
    args = ["template", "saga-release", str(CHART), "--namespace", NAMESPACE, *extra]
    if values is not None:
        args += ["--values", str(values)]
    done = run_helm(helm, *args)
    assert done.returncode == 0, f"helm template failed:\n{done.stderr}"
    manifests = [m for m in yaml.safe_load_all(done.stdout) if m]
    assert all(isinstance(m, dict) for m in manifests)
    return manifests


@pytest.fixture(scope="module")
def rendered(helm: str) -> dict[str, list[Manifest]]:
    return {_values_id(v): render(helm, v) for v in VALUES_FILES}


def of_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


def component(manifest: Manifest) -> str | None:
    labels = manifest["metadata"].get("labels") or {}
    value = labels.get("app.kubernetes.io/component")
    return None if value is None else str(value)


def pod_spec(manifest: Manifest) -> dict[str, Any] | None:
    """The pod spec of a workload (None for anything else)."""
    spec = manifest.get("spec") or {}
    if manifest["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    template = spec.get("template")
    if manifest["kind"] not in {"Deployment", "StatefulSet", "Job", "CronJob", "DaemonSet"}:
        return None
    assert isinstance(template, dict)
    pod = template["spec"]
    assert isinstance(pod, dict)
    return pod


def containers(manifests: list[Manifest]) -> Iterator[tuple[Manifest, dict[str, Any]]]:
    for manifest in manifests:
        pod = pod_spec(manifest)
        if pod is None:
            continue
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            yield manifest, container


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


@NEEDS_HELM
@BUILD_TIMEOUT
@pytest.mark.parametrize("values", VALUES_FILES, ids=_values_id)
def test_helm_lint_passes(helm: str, values: Path | None) -> None:
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    if values is not None:
        args += ["--values", str(values)]
    done = run_helm(helm, *args)
    assert done.returncode == 0, f"helm lint failed:\n{done.stdout}\n{done.stderr}"
    assert "0 chart(s) failed" in done.stdout


def kubernetes_versions() -> list[str]:
    """The oldest version the chart supports (or the oldest schema shipped) and the newest."""
    import kubernetes_validate
    from kubernetes_validate.utils import all_versions

    def key(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in version.split("."))

    shipped = sorted(all_versions(), key=key)
    oldest = next((v for v in shipped if key(v) >= (1, 25)), shipped[0])
    return sorted({oldest, kubernetes_validate.latest_version()}, key=key)


def check_service_monitor(monitor: Manifest, manifests: list[Manifest]) -> None:
    spec = monitor["spec"]
    assert monitor["metadata"]["name"]
    assert set(spec) <= {"jobLabel", "selector", "namespaceSelector", "endpoints"}, spec
    selector = spec["selector"]["matchLabels"]
    assert selector and all(isinstance(v, str) for v in selector.values())
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert spec["endpoints"]
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "scheme", "interval", "scrapeTimeout"}, endpoint
        assert endpoint["path"] == "/metrics"
        for field in ("interval", "scrapeTimeout"):
            assert re.fullmatch(r"[0-9]+(ms|s|m|h)", endpoint[field]), endpoint
    # It selects the Service of the coordinator and of each participant, and names a port
    # and a job label each of them has; not the console's.
    selected = [
        s
        for s in of_kind(manifests, "Service")
        if selector.items() <= (s["metadata"].get("labels") or {}).items()
    ]
    assert sorted(component(s) or "" for s in selected) == sorted(
        ["coordinator"] + ["participant"] * len(of_kind_component(manifests, "participant"))
    )
    for service in selected:
        assert spec["jobLabel"] in service["metadata"]["labels"]
        ports = {p["name"] for p in service["spec"]["ports"]}
        assert {e["port"] for e in spec["endpoints"]} <= ports


def check_prometheus_rule(rule: Manifest, exported: frozenset[str]) -> None:
    groups = rule["spec"]["groups"]
    assert groups
    alerts = set()
    for group in groups:
        assert group["name"] and group["rules"]
        for item in group["rules"]:
            keys = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}
            assert set(item) <= keys, item
            assert ("alert" in item) != ("record" in item), item
            assert isinstance(item["expr"], str) and item["expr"].strip()
            if "for" in item:
                assert re.fullmatch(r"[0-9]+(ms|s|m|h|d)", item["for"]), item
            if "alert" in item:
                alerts.add(item["alert"])
                assert item["labels"]["severity"] in {"critical", "warning", "info"}, item
                assert all(isinstance(v, str) for v in item["annotations"].values())
            names = metric_names(item["expr"])
            assert names, item["expr"]
            unknown = names - exported - PROMETHEUS_SERIES
            assert not unknown, f"{item['expr']!r} reads {sorted(unknown)}: not exported"
            assert f'namespace="{NAMESPACE}"' in item["expr"], "rules are scoped to the release"
    assert {"SagaNeedsAnOperator", "SagaDeadLetters", "SagaConsumerLag"} <= alerts


def of_kind_component(manifests: list[Manifest], name: str) -> list[Manifest]:
    return [
        m for m in manifests if m["kind"] in {"Deployment", "StatefulSet"} and component(m) == name
    ]


@NEEDS_HELM
@BUILD_TIMEOUT
@pytest.mark.parametrize("values", VALUES_FILES, ids=_values_id)
def test_every_rendered_object_is_valid_kubernetes(
    rendered: dict[str, list[Manifest]],
    values: Path | None,
    exported_metrics: frozenset[str],  # noqa: F811
) -> None:
    import kubernetes_validate

    manifests = rendered[_values_id(values)]
    assert manifests
    versions = kubernetes_versions()
    problems: list[str] = []
    for manifest in manifests:
        name = f"{manifest.get('kind')}/{manifest.get('metadata', {}).get('name')}"
        assert set(manifest) >= {"apiVersion", "kind", "metadata"}, name
        if manifest["apiVersion"].startswith("monitoring.coreos.com/"):
            # Custom resources: not in the Kubernetes schemas; checked by structure.
            assert manifest["apiVersion"] == "monitoring.coreos.com/v1", name
            if manifest["kind"] == "ServiceMonitor":
                check_service_monitor(manifest, manifests)
            elif manifest["kind"] == "PrometheusRule":
                check_prometheus_rule(manifest, exported_metrics)
            else:
                pytest.fail(f"unexpected custom resource {name}")
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(manifest, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = "/".join(str(part) for part in exc.absolute_path)
                problems.append(
                    f"{name} is not valid Kubernetes {version}: at {where}: {exc.message}"
                )
    assert not problems, "\n".join(problems)


@NEEDS_HELM
@BUILD_TIMEOUT
def test_the_full_values_turn_every_optional_object_on(
    rendered: dict[str, list[Manifest]],
) -> None:
    kinds = {m["kind"] for m in rendered[FULL_VALUES.name]}
    assert {
        "StatefulSet",
        "Deployment",
        "Service",
        "Ingress",
        "CronJob",
        "Job",
        "ServiceMonitor",
        "PrometheusRule",
        "PodDisruptionBudget",
        "ServiceAccount",
    } <= kinds
    assert len(of_kind_component(rendered[FULL_VALUES.name], "participant")) >= 3
    # Every secret of the full values comes from an existing Secret: the chart makes none.
    assert not of_kind(rendered[FULL_VALUES.name], "Secret")
    all_kinds = {m["kind"] for ms in rendered.values() for m in ms}
    assert {"Secret", "PersistentVolumeClaim"} <= all_kinds


@NEEDS_HELM
@BUILD_TIMEOUT
def test_the_coordinator_is_a_stateful_set_whose_pod_name_is_its_instance_id(
    rendered: dict[str, list[Manifest]],
) -> None:
    for values, manifests in rendered.items():
        coordinators = [m for m in manifests if component(m) == "coordinator"]
        workloads = [m for m in coordinators if pod_spec(m) is not None]
        assert [m["kind"] for m in workloads] == ["StatefulSet"], values
        statefulset = workloads[0]
        service = next(
            m
            for m in of_kind(manifests, "Service")
            if m["metadata"]["name"] == statefulset["spec"]["serviceName"]
        )
        assert service["spec"]["clusterIP"] == "None", "the StatefulSet's Service is headless"
        container = pod_spec(statefulset)["containers"][0]  # type: ignore[index]
        assert container["args"][:2] == ["coordinator", "run"]
        assert "--instance-id" not in container["args"]
        instance = env_of(container)["SAGA_INSTANCE_ID"]
        assert instance["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


@NEEDS_HELM
@BUILD_TIMEOUT
def test_probes_hit_healthz_and_readyz_on_the_metrics_port(
    rendered: dict[str, list[Manifest]],
) -> None:
    for values, manifests in rendered.items():
        for manifest, container in containers(manifests):
            kind = component(manifest)
            if kind in {"coordinator", "participant"}:
                args = container["args"]
                port = int(args[args.index("--metrics-port") + 1])
                assert args[args.index("--metrics-host") + 1] == "0.0.0.0"
                ports = {p["name"]: p["containerPort"] for p in container["ports"]}
                assert ports["metrics"] == port, values
                for probe, path in (
                    ("startupProbe", "/healthz"),
                    ("livenessProbe", "/healthz"),
                    ("readinessProbe", "/readyz"),
                ):
                    get = container[probe]["httpGet"]
                    assert (get["path"], get["port"]) == (path, "metrics"), (values, probe)
            elif kind == "console":
                args = container["args"]
                port = int(args[args.index("--port") + 1])
                for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                    get = container[probe]["httpGet"]
                    assert (get["path"], get["port"]) == ("/healthz", "http")
                    # The console refuses a Host it does not know (DNS rebinding).
                    assert {"name": "Host", "value": f"localhost:{port}"} in get["httpHeaders"]


def secret_values(manifests: list[Manifest], values: Path | None) -> set[str]:
    """The values of every Secret the chart made, and every secret-looking value given."""
    found: set[str] = set()
    for secret in of_kind(manifests, "Secret"):
        for value in (secret.get("data") or {}).values():
            found.add(base64.b64decode(value).decode())
        found.update((secret.get("stringData") or {}).values())
    if values is not None:
        text = values.read_text(encoding="utf-8")
        found.update(re.findall(r"(?:password|value|url):\s*(\S*-pw-\S*)", text))
    return {v for v in found if len(v) >= 6}


SECRET_ENV = re.compile(r"PASSWORD|SECRET|_URL|^SAGA_CONSOLE_DB$|^SAGA_STORAGE_URL$")


@NEEDS_HELM
@BUILD_TIMEOUT
def test_no_secret_reaches_a_command_line_or_a_plain_env_value(
    rendered: dict[str, list[Manifest]],
) -> None:
    created = rendered[CREATED_SECRETS_VALUES.name]
    assert len(of_kind(created, "Secret")) >= 5, "the chart makes its Secrets from values"
    for values in VALUES_FILES:
        manifests = rendered[_values_id(values)]
        secrets = secret_values(manifests, values)
        if values == CREATED_SECRETS_VALUES:
            assert {"kafka-pw-0b7f3e2a", "coordinator-private-key-material-5a5a5a"} <= secrets
        for manifest, container in containers(manifests):
            where = f"{_values_id(values)}: {manifest['metadata']['name']}/{container['name']}"
            words = [*container.get("command", []), *container.get("args", [])]
            for word in words:
                assert not any(s in word for s in secrets), f"{where}: a secret in {word!r}"
                assert not re.search(r"://[^/\s:@]*:[^@\s/]+@", word), f"{where}: {word!r}"
            assert not {"--url", "--password-file", "--kafka-config"} & set(words), where
            for name, env in env_of(container).items():
                if "value" in env:
                    assert not any(s in str(env["value"]) for s in secrets), f"{where}: {name}"
                if SECRET_ENV.search(name) and name != "SAGA_KAFKA_SSL_CA_LOCATION":
                    assert "secretKeyRef" in env.get("valueFrom", {}), f"{where}: {name}"


@NEEDS_HELM
@BUILD_TIMEOUT
def test_one_participant_deployment_per_entry_with_its_url_from_a_secret(
    rendered: dict[str, list[Manifest]],
) -> None:
    participants = yaml.safe_load(FULL_VALUES.read_text(encoding="utf-8"))["participants"]
    deployments = of_kind_component(rendered[FULL_VALUES.name], "participant")
    assert [d["kind"] for d in deployments] == ["Deployment"] * len(participants)
    by_name = {}
    for deployment in deployments:
        container = pod_spec(deployment)["containers"][0]  # type: ignore[index]
        args = container["args"]
        by_name[args[args.index("--name") + 1]] = (deployment, container)
    assert set(by_name) == {p["name"] for p in participants}
    for entry in participants:
        deployment, container = by_name[entry["name"]]
        args = container["args"]
        assert args[args.index("--storage") + 1] == entry["storage"]
        assert args[args.index("--targets") + 1] == ",".join(entry["targets"])
        assert deployment["spec"]["replicas"] == entry.get("replicas", 1)
        ref = env_of(container)["SAGA_STORAGE_URL"]["valueFrom"]["secretKeyRef"]
        url = entry["storageUrl"]
        assert ref == {"name": url["existingSecret"], "key": url.get("key", "url")}


@NEEDS_HELM
@BUILD_TIMEOUT
def test_the_reconcile_cron_job_takes_its_schedule_and_spark_master(
    rendered: dict[str, list[Manifest]],
) -> None:
    values = yaml.safe_load(FULL_VALUES.read_text(encoding="utf-8"))["reconcile"]
    (cronjob,) = of_kind(rendered[FULL_VALUES.name], "CronJob")
    assert cronjob["spec"]["schedule"] == values["schedule"]
    container = pod_spec(cronjob)["containers"][0]  # type: ignore[index]
    assert container["args"][0] == "reconcile"
    env = env_of(container)
    assert env["SAGA_SPARK_MASTER"]["value"] == values["spark"]["master"]
    ledgers = [container["args"][i + 1] for i, a in enumerate(container["args"]) if a == "--ledger"]
    assert len(ledgers) == len(values["ledgerParticipants"]) + len(values["ledgers"])
    for spec in ledgers:
        variable = re.fullmatch(r"(sql|mongo|redis):\$(\w+)(#.*)?", spec)
        assert variable, spec
        assert "secretKeyRef" in env[variable.group(2)]["valueFrom"]
    assert not of_kind(rendered["defaults"], "CronJob"), "the CronJob is optional (off by default)"


@NEEDS_HELM
@BUILD_TIMEOUT
def test_the_rendered_command_lines_parse_with_the_product_cli(
    rendered: dict[str, list[Manifest]],
) -> None:
    """Every flag the chart passes exists: the product's click commands parse the args."""
    import click

    cli = product("coordinator.cli")
    for values, manifests in rendered.items():
        for _manifest, container in containers(manifests):
            args = [a.replace("$(POD_IP)", "10.0.0.1") for a in container["args"]]
            command: click.Command = cli.main
            ctx = click.Context(command, info_name="saga")
            rest = list(args)
            while isinstance(command, click.Group):
                sub = command.get_command(ctx, rest[0])
                assert sub is not None, f"{values}: no command {rest[0]!r} in {args}"
                command, rest = sub, rest[1:]
                ctx = click.Context(command, info_name=command.name, parent=ctx)
            try:
                command.make_context(command.name, rest, parent=ctx.parent)
            except click.UsageError as exc:
                pytest.fail(f"{values}: saga {' '.join(args)}: {exc.format_message()}")


@NEEDS_HELM
@BUILD_TIMEOUT
def test_invalid_values_are_refused_by_the_schema(helm: str) -> None:
    bad = {
        "participants[0].storage=sqlite": "storage",
        "coordinator.replicaz=2": "replicaz",
        "retention=7 days": "retention",
    }
    for setting, word in bad.items():
        name, value = setting.split("=", 1)
        args = ["template", "x", str(CHART), "--set-string", f"{name}={value}"]
        if name.startswith("participants"):
            args += ["--set", "participants[0].name=a", "--set", "participants[0].targets={t}"]
            args += ["--set", "participants[0].storageUrl.existingSecret=s"]
        done = run_helm(helm, *args)
        assert done.returncode != 0, setting
        assert word in done.stderr, done.stderr


@NEEDS_HELM
@BUILD_TIMEOUT
@pytest.mark.parametrize("values", VALUES_FILES, ids=_values_id)
def test_the_install_notes_render(helm: str, values: Path | None, tmp_path: Path) -> None:
    """NOTES.txt (rendered by `helm install`, not by `helm template`) has no template error."""
    chart = tmp_path / "saga"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "notes.txt")
    (chart / "templates" / "notes.yaml").write_text(
        'notes: {{ tpl (.Files.Get "notes.txt") . | toJson }}\n', encoding="utf-8"
    )
    args = ["template", "shop", str(chart), "--namespace", NAMESPACE]
    args += ["--show-only", "templates/notes.yaml"]
    if values is not None:
        args += ["--values", str(values)]
    done = run_helm(helm, *args)
    assert done.returncode == 0, done.stderr
    notes = yaml.safe_load(done.stdout)["notes"]
    assert "statefulset/shop-saga-coordinator" in notes
    assert "<no value>" not in notes, notes
