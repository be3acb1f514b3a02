"""deploy/k8s offline: every built-in object validates strictly against the Kubernetes 1.31 schemas
that PyPI's kubernetes-validate ships; ServiceMonitor and PrometheusRule validate against the
openAPIV3Schema of prometheus-operator v0.93.0's CRDs (vendored in deploy/k8s/schemas/, made strict
here: unknown fields are errors, as with `kubectl apply --validate=strict`); the objects agree with
each other, with docker-compose.yml and with the rule files; the prometheus-adapter query, rendered
for concrete pods, gives the per-pod p99 in seconds when promtool evaluates it."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import textwrap

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.support.prometheus_helpers import DEPLOY, PROJECT_ROOT, adapter_rule, load_yaml, promtool, render_adapter_query

K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.31.0"
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): K8S / "schemas" / "servicemonitor-monitoring-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): K8S / "schemas" / "prometheusrule-monitoring-v1.json",
}


def manifests() -> dict[str, dict]:
    """kind -> object, from the files the kustomization lists."""
    kustomization = load_yaml(K8S / "kustomization.yaml")
    objects = {}
    for name in kustomization["resources"]:
        for obj in yaml.safe_load_all((K8S / name).read_text()):
            assert obj["kind"] not in objects
            objects[obj["kind"]] = obj
    return objects


def strict(schema):
    """A CRD schema with unknown properties rejected (the API server would prune them silently)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            pattern = node.get("pattern")
            if isinstance(pattern, str) and "(?i)" in pattern[1:]:
                # Go allows `^(?i)...`; Python wants a global flag first.
                node["pattern"] = "(?i)" + pattern.replace("(?i)", "")
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    # metadata is `type: object` in a CRD schema; the API server checks it as ObjectMeta.
    return schema


def validate(obj: dict) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        schema = strict(json.loads(CRD_SCHEMAS[key].read_text()))
        jsonschema.validate(obj, schema, cls=jsonschema.Draft7Validator)
    else:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    listed = set(load_yaml(K8S / "kustomization.yaml")["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "prometheus-adapter-rules.yaml"}
    assert listed == on_disk
    assert set(manifests()) == {"Namespace", "Deployment", "Service", "ServiceMonitor", "PrometheusRule",
                                "HorizontalPodAutoscaler"}


@pytest.mark.parametrize("kind", ["Namespace", "Deployment", "Service", "ServiceMonitor", "PrometheusRule",
                                  "HorizontalPodAutoscaler"])
def test_manifest_validates_against_its_schema(kind):
    validate(manifests()[kind])


@pytest.mark.parametrize("kind, path, typo", [
    ("Deployment", ("spec", "template", "spec", "containers", 0), "readinesProbe"),
    ("HorizontalPodAutoscaler", ("spec",), "minReplica"),
    ("ServiceMonitor", ("spec", "endpoints", 0), "intervall"),
    ("PrometheusRule", ("spec", "groups", 0), "rule"),
])
def test_validation_rejects_a_misspelt_field(kind, path, typo):
    """The validators above are strict, not silently passing unknown kinds or fields."""
    obj = copy.deepcopy(manifests()[kind])
    node = obj
    for step in path:
        node = node[step]
    node[typo] = node.get(typo, 1)
    with pytest.raises(jsonschema.ValidationError):
        validate(obj)


def test_no_object_of_an_unknown_kind_is_skipped():
    """kubernetes-validate only warns on a kind it has no schema for; ours are all covered."""
    for obj in manifests().values():
        if (obj["apiVersion"], obj["kind"]) not in CRD_SCHEMAS:
            assert kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True) == "1.31"


def test_deployment_runs_the_compose_command_with_gpu_shm_and_probes():
    deployment = manifests()["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (triton,) = pod["containers"]
    compose = load_yaml(PROJECT_ROOT / "docker-compose.yml")["services"]["triton"]
    assert triton["command"] == compose["command"]
    assert triton["image"] == compose["image"]
    assert set(compose["environment"]) <= {variable["name"] for variable in triton["env"]}
    assert {p["name"]: p["containerPort"] for p in triton["ports"]} == {"http": 8000, "grpc": 8001, "metrics": 8002}
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == 1
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in triton["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"].endswith("Gi")  # its size: tests/unit/builder/test_shm_sizes.py
    # The repository: the init container builds the gpu target into the volume Triton reads.
    repository = triton["command"][triton["command"].index("--model-repository") + 1]
    assert mounts[repository]["readOnly"] is True
    (builder,) = pod["initContainers"]
    assert builder["command"][:3] == ["python", "-m", "repo_builder"]
    assert builder["command"][builder["command"].index("--target") + 1] == "gpu"
    output = builder["command"][builder["command"].index("--output") + 1]
    assert {m["mountPath"]: m["name"] for m in builder["volumeMounts"]}[output] == mounts[repository]["name"]
    assert builder["image"] == load_yaml(PROJECT_ROOT / "docker-compose.yml")["services"]["repository-builder"]["image"]
    # readiness sees dead stubs (/v2/health/ready), liveness only the process.
    assert triton["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert triton["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    # The startup probe gates real readiness (nginx answers /live at once), for at least as long as
    # the launcher itself waits for the start-up load (one source: launcher.READY_TIMEOUT_S).
    from triton_pipelines.server.launcher import READY_TIMEOUT_S

    assert triton["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert triton["startupProbe"]["periodSeconds"] * triton["startupProbe"]["failureThreshold"] >= READY_TIMEOUT_S + 60
    # Room for the drain as in docker compose (stop_grace_period), plus the preStop sleep.
    grace = int(compose["stop_grace_period"].rstrip("s"))
    assert pod["terminationGracePeriodSeconds"] >= grace + int(triton["lifecycle"]["preStop"]["exec"]["command"][1])
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_service_servicemonitor_and_alerts_agree_on_labels_ports_and_job():
    objects = manifests()
    pod_labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    service = objects["Service"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    container_ports = {p["name"] for p in objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= container_ports
    monitor = objects["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    (endpoint,) = monitor["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]}[endpoint["port"]] == 8002
    # The job label comes from the Service's label: the same job as docker compose's scrape config
    # and as the TritonMetricsDown alert.
    job = service["metadata"]["labels"][monitor["jobLabel"]]
    prometheus = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    assert [c["job_name"] for c in prometheus["scrape_configs"]] == [job]
    assert f'up{{job="{job}"}}' in (DEPLOY / "prometheus" / "rules" / "alerts.yml").read_text()
    namespaces = {obj["metadata"].get("namespace") for kind, obj in objects.items() if kind != "Namespace"}
    assert namespaces == {objects["Namespace"]["metadata"]["name"]}


def test_prometheusrule_is_generated_from_the_rule_files():
    result = subprocess.run([sys.executable, "-c", "import render_prometheusrule as r; print(r.render(), end='')"],
                            cwd=K8S, capture_output=True, text=True, check=True)
    assert result.stdout == (K8S / "prometheusrule.yaml").read_text(), "run `make k8s-rules`"
    groups = manifests()["PrometheusRule"]["spec"]["groups"]
    assert groups == [g for name in ("recording.yml", "alerts.yml")
                      for g in load_yaml(DEPLOY / "prometheus" / "rules" / name)["groups"]]


def test_hpa_scales_the_deployment_on_the_adapter_metric():
    objects = manifests()
    hpa = objects["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": objects["Deployment"]["metadata"]["name"]}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 10)
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "100m"}  # 0.1 s
    rule = adapter_rule()
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert re.fullmatch(rule["name"]["matches"], "nv_inference_queue_summary_us")
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
    assert hpa["behavior"]["scaleUp"]["stabilizationWindowSeconds"] == 0


def test_adapter_query_gives_each_pods_p99_queue_time_in_seconds(tmp_path):
    """Render the adapter's template as the adapter does for the HPA's request (the Pods metric of
    two pods in namespace triton, grouped by pod) and evaluate it on per-pod summaries."""
    rule = adapter_rule()
    series = re.match(r"(\w+)\{", rule["seriesQuery"]).group(1)
    query = render_adapter_query(rule["metricsQuery"], series,
                                 'namespace="triton",pod=~"triton-a|triton-b"', "pod")
    input_series = [
        # Pod a: text_encoder queues for 150 ms at p99, resnet50 for 20 ms, whisper idle (NaN).
        ("triton", "triton-a", "text_encoder", "0.99", "150000x4"),
        ("triton", "triton-a", "resnet50", "0.99", "20000x4"),
        ("triton", "triton-a", "whisper_encoder", "0.99", "NaN NaN NaN NaN NaN"),
        ("triton", "triton-a", "text_encoder", "0.5", "900000x4"),  # another quantile: ignored
        # Pod b: every model idle -> 0, not absent.
        ("triton", "triton-b", "text_encoder", "0.99", "NaN NaN NaN NaN NaN"),
        # Another namespace's pod of the same name pattern: not selected.
        ("staging", "triton-a", "text_encoder", "0.99", "999000x4"),
    ]
    lines = [f"""      - series: '{series}{{namespace="{ns}",pod="{pod}",model="{model}",version="1",quantile="{q}"}}'
        values: '{values}'""" for ns, pod, model, q, values in input_series]
    test_file = tmp_path / "adapter_test.yml"
    test_file.write_text(textwrap.dedent("""\
        rule_files: []
        evaluation_interval: 1m
        tests:
          - interval: 1m
            input_series:
        """) + "\n".join(lines) + "\n" + textwrap.indent(textwrap.dedent(f"""\
        promql_expr_test:
          - expr: {json.dumps(query)}
            eval_time: 3m
            exp_samples:
              - labels: '{{pod="triton-a"}}'
                value: 0.15
              - labels: '{{pod="triton-b"}}'
                value: 0
        """), "    "))
    result = promtool("test", "rules", str(test_file))
    assert result.returncode == 0, query + "\n" + result.stdout + result.stderr


def test_init_container_has_the_memory_its_whisper_export_needs():
    """8Gi was OOMKilled exporting large-v3 (~6.2 GB of fp32 weights, held about three times): the
    default gpu build exports it wherever the hub can be reached."""
    from repo_builder.export.whisper import WHISPER_SIZES, export_memory_bytes
    from repo_builder.speech_pipeline import default_architectures

    (builder,) = manifests()["Deployment"]["spec"]["template"]["spec"]["initContainers"]
    command = builder["command"]
    assert "--whisper-size" not in command  # random weights: benchmarks only
    spec = command[command.index("--whisper-model") + 1] if "--whisper-model" in command else "default"
    sizes = default_architectures("gpu") if spec == "default" else [spec.removeprefix("random:")]
    assert set(sizes) <= set(WHISPER_SIZES), f"size the init container's memory for {spec}"
    size = max(sizes, key=export_memory_bytes)
    limit = builder["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(limit[:-2]) << 30 >= export_memory_bytes(size)
    assert builder["resources"]["requests"]["memory"] == limit  # scheduled where it fits


def test_images_are_mapped_to_a_registry_by_kustomize():
    """Local tags (what compose builds) cannot be pulled by a cluster: kustomize's images: names them."""
    kustomization = load_yaml(K8S / "kustomization.yaml")
    mapped = {entry["name"]: entry for entry in kustomization.get("images", [])}
    pod = manifests()["Deployment"]["spec"]["template"]["spec"]
    for container in pod["initContainers"] + pod["containers"]:
        name = container["image"].split(":")[0]
        assert name in mapped and "/" in mapped[name]["newName"] and mapped[name]["newTag"] != "latest"
    assert "docker push" in (K8S / "kustomization.yaml").read_text()


def test_the_builders_keep_the_hugging_face_cache_in_a_volume_and_ask_for_no_random_weights():
    """Issue 32: a model fetched by id is downloaded once (the cache volume where HF_HOME points, in
    both compose builders and the init container), and no default build serves random weights."""
    compose = load_yaml(PROJECT_ROOT / "docker-compose.yml")
    for name in ("repository-builder", "repository-builder-cpu"):
        service = compose["services"][name]
        home = service["environment"]["HF_HOME"]
        (mount,) = [v for v in service["volumes"] if v.endswith(":" + home)]
        assert mount.split(":")[0] in compose["volumes"], mount  # a named volume, not the working copy
        assert not any(arg == "--whisper-size" or "random:" in arg for arg in service["command"]), name
    pod = manifests()["Deployment"]["spec"]["template"]["spec"]
    (builder,) = pod["initContainers"]
    home = {variable["name"]: variable.get("value") for variable in builder["env"]}["HF_HOME"]
    volume = {m["mountPath"]: m["name"] for m in builder["volumeMounts"]}[home]
    assert volume in {v["name"] for v in pod["volumes"]}
    assert not any(arg == "--whisper-size" or "random:" in arg for arg in builder["command"])
