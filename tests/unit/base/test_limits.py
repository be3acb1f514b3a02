"""Each cross-process limit lives once, in triton_pipelines.limits; every file that must restate one
(the route table, built configs, nginx's rendered configuration) is tied to it here, and no module
defines its own copy."""

from __future__ import annotations

import ast
import re

import yaml

from triton_pipelines import limits
from tests.support.paths import PROJECT_ROOT

SOURCES = [*(PROJECT_ROOT / "src").rglob("*.py"), *(PROJECT_ROOT / "build").rglob("*.py")]
FACTS = [name for name in vars(limits) if name.isupper()]


def assignments(path) -> dict[str, ast.expr]:
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            found[node.target.id] = node.value
    return found


def test_no_module_defines_a_fact_of_its_own():
    """A name of limits.py assigned a literal anywhere else is a second definition."""
    twice = []
    for path in SOURCES:
        if path == PROJECT_ROOT / "src" / "triton_pipelines" / "limits.py":
            continue
        for name, value in assignments(path).items():
            if name in FACTS and not isinstance(value, (ast.Name, ast.Attribute)):
                twice.append(f"{path.relative_to(PROJECT_ROOT)}: {name}")
    assert not twice, twice


def test_the_modules_use_the_facts():
    from triton_pipelines.client import TritonClient
    from triton_pipelines.front import nginx_config
    from triton_pipelines.front import screen_server
    from triton_pipelines.openai_api import protocol
    from triton_pipelines.pipelines import text
    from triton_pipelines.pipelines.speech import config as speech_config
    from triton_pipelines.repository.routes import RouteTable

    assert nginx_config.ProxyConfig.__dataclass_fields__["upstream_timeout_s"].default == limits.REQUEST_TIMEOUT_S
    assert screen_server.UPSTREAM_TIMEOUT_S == limits.REQUEST_TIMEOUT_S
    assert TritonClient.__init__.__defaults__[0] == limits.REQUEST_TIMEOUT_S
    assert protocol.MAX_TEXT_BYTES == text.MAX_TEXT_BYTES == limits.MAX_TEXT_BYTES
    assert speech_config.MAX_AUDIO_BYTES == limits.DEFAULT_MAX_BODY_BYTES
    assert RouteTable.__dataclass_fields__["triton_deadline_s"].default == limits.SELF_HOSTED_DEADLINE_S
    assert RouteTable.__dataclass_fields__["max_rows_per_request"].default == limits.TEXT_MAX_BATCH


def test_the_route_table_restates_the_facts():
    routes = yaml.safe_load((PROJECT_ROOT / "data" / "routes.yaml").read_text())
    assert routes["limits"]["triton_deadline_s"] == limits.SELF_HOSTED_DEADLINE_S
    assert routes["limits"]["max_rows_per_request"] == limits.TEXT_MAX_BATCH
    assert routes["tasks"]["speech_recognition"]["deadline_s"] == limits.REQUEST_TIMEOUT_S


def test_the_builder_and_the_built_configs_restate_the_facts():
    from repo_builder import text_pipeline

    assert text_pipeline.MAX_BATCH_SIZE == limits.TEXT_MAX_BATCH
    built = PROJECT_ROOT / "model_repository"
    tokenizer = (built / "text_tokenizer" / "config.pbtxt").read_text()
    found = re.search(r'key: "max_text_bytes"\s*value \{\s*string_value: "(\d+)"', tokenizer)
    assert found and int(found.group(1)) == limits.MAX_TEXT_BYTES
    embedding = (built / "text_embedding" / "config.pbtxt").read_text()
    assert re.search(r"^max_batch_size: (\d+)", embedding, re.M).group(1) == str(limits.TEXT_MAX_BATCH)


def test_nginx_restates_the_facts():
    """The golden rendering of the default configuration (tests/unit/front/test_nginx_config.py
    holds it equal to render_config's output)."""
    text = (PROJECT_ROOT / "tests" / "data" / "nginx" / "one_replica.conf").read_text()
    assert f"proxy_read_timeout {int(limits.REQUEST_TIMEOUT_S)}s;" in text
    assert f"client_max_body_size {limits.DEFAULT_MAX_BODY_BYTES};" in text
    assert f"client_max_body_size {limits.DEFAULT_MAX_JSON_BYTES};" in text


def test_the_kubernetes_deployment_restates_the_request_bytes_in_flight():
    deployment = next(d for d in yaml.safe_load_all((PROJECT_ROOT / "deploy/k8s/deployment.yaml").read_text())
                      if d and d.get("kind") == "Deployment")
    env = {e["name"]: e.get("value") for c in deployment["spec"]["template"]["spec"]["containers"]
           for e in c.get("env", [])}
    assert int(env["TRITON_MAX_INFLIGHT_BYTES"]) == limits.DEFAULT_MAX_INFLIGHT_BYTES
