"""Tracing in the deployments, offline: every server of docker-compose.yml (both profiles) and the
Kubernetes Deployment pass the standard OTEL_* variables that telemetry/tracing.py reads; the
optional `tracing` compose profile runs Jaeger, which takes OTLP over HTTP where the documented
endpoint points and shows the traces on the host's loopback only."""

from __future__ import annotations

from triton_pipelines.telemetry import tracing

from tests.support.paths import PROJECT_ROOT
from tests.unit.deploy.test_images import compose
from tests.unit.deploy.test_k8s import K8S, load_yaml, manifests

VARIABLES = {tracing.ENDPOINT_ENV, tracing.SAMPLER_ENV, tracing.SAMPLER_ARG_ENV, tracing.SERVICE_NAME_ENV,
             tracing.RESOURCE_ENV}
DOCUMENTED_ENDPOINT = "http://jaeger:4318"


def test_every_compose_server_passes_the_otel_variables():
    services = load_yaml(PROJECT_ROOT / "docker-compose.yml")["services"]
    for name in ("triton", "triton-cpu"):
        environment = services[name]["environment"]
        assert VARIABLES <= set(environment), name
        assert all(environment[v] == f"${{{v}:-}}" for v in VARIABLES), "unset by default: nothing traced"


def test_the_tracing_profile_runs_jaeger_where_the_documented_endpoint_points():
    assert "jaeger" not in compose("config", "--services").split()  # optional
    assert set(compose("config", "--services", profile="tracing").split()) >= {"jaeger"}
    jaeger = load_yaml(PROJECT_ROOT / "docker-compose.yml")["services"]["jaeger"]
    host, port = DOCUMENTED_ENDPOINT.removeprefix("http://").split(":")
    assert host == "jaeger" and port in jaeger["expose"]
    assert jaeger["image"].split(":")[1][0].isdigit()  # pinned
    assert all(p.startswith("127.0.0.1:") for p in jaeger["ports"])  # the UI has no authentication
    assert DOCUMENTED_ENDPOINT in (PROJECT_ROOT / "docker-compose.yml").read_text()
    assert DOCUMENTED_ENDPOINT in (PROJECT_ROOT / "docs" / "operations.md").read_text()


def test_the_deployment_passes_the_otel_variables_from_an_optional_configmap():
    (container,) = [c for c in manifests()["Deployment"]["spec"]["template"]["spec"]["containers"]
                    if c["name"] == "triton"]
    env = {e["name"]: e for e in container["env"]}
    assert VARIABLES <= set(env)
    endpoint = env[tracing.ENDPOINT_ENV]["valueFrom"]["configMapKeyRef"]
    assert endpoint["optional"] is True  # no ConfigMap: nothing traced, the pod still starts
    assert (K8S / "deployment.yaml").exists()
