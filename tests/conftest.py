"""Fixtures: the real embedded Triton server, started once per session on free ports, and clients
for both protocols.

The repository is the one `make repository` builds (`make test` builds it first); if it is missing
the fixture builds it. `TEST_MODEL_REPOSITORY=DIR` points the tests at another built repository
(e.g. one built with `--pipelines text`). `TEST_SERVER_STATE=DIR` attaches the tests to a launcher that
is already running (its state folder), e.g. the Python 3.10 rehearsal of the container
(tests/test_images.py). Server logs go to `.cache/test-server.log`.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest

from triton_pipelines.client import TritonClient
from triton_pipelines.launcher import RunningServer, start_on_free_ports

from .fake_gateway import FakeGateway

PROJECT_ROOT = Path(__file__).resolve().parents[1]
MODEL_REPOSITORY = Path(os.environ.get("TEST_MODEL_REPOSITORY", PROJECT_ROOT / "model_repository")).resolve()
LOG_DIR = PROJECT_ROOT / ".cache"


def ensure_repository() -> Path:
    if not (MODEL_REPOSITORY / ".built").exists():
        from repo_builder.__main__ import main as build

        build(["--target", "embedded", "--output", str(MODEL_REPOSITORY)])
    return MODEL_REPOSITORY


@pytest.fixture(scope="session")
def triton_server():
    if os.environ.get("TEST_SERVER_STATE"):
        yield RunningServer(Path(os.environ["TEST_SERVER_STATE"]))
        return
    server = start_on_free_ports(ensure_repository(), LOG_DIR / "test-server.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def compute_server():
    """A server with only the compute models (started when a test first asks for it): tests that
    reload them with new instances (warm-up at load, the memory planner's measurements) use it, so
    the session server is not disturbed."""
    server = start_on_free_ports(ensure_repository(), LOG_DIR / "test-compute-server.log",
                                 models=["text_encoder", "resnet50", "whisper_encoder", "whisper_decoder"],
                                 expose_internal_models=True)
    yield server
    server.stop()


@pytest.fixture(scope="session", params=["http", "grpc"])
def client(request, triton_server) -> TritonClient:
    """Parametrizes a test over both protocols."""
    c = TritonClient(request.param, triton_server.url(request.param))
    yield c
    c.close()


@pytest.fixture(scope="session", params=["http", "grpc"])
def internal_client(request, triton_server) -> TritonClient:
    """A client of Triton's own loopback ports, for tests of one internal model (the public ports
    serve inference for the pipelines and the router only); both protocols."""
    c = TritonClient(request.param, triton_server.internal_url(request.param))
    yield c
    c.close()


@pytest.fixture(scope="session")
def http_client(triton_server) -> TritonClient:
    c = TritonClient("http", triton_server.http_url)
    yield c
    c.close()


@contextlib.contextmanager
def gateway_environment(base_url: str, key: str):
    """LLM_GATEWAY_BASE_URL / LLM_GATEWAY_API_KEY for a server started inside the block (the
    router reads them at load); the test process's own values are restored after."""
    names = ("LLM_GATEWAY_BASE_URL", "LLM_GATEWAY_API_KEY")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(dict(zip(names, (base_url, key))))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def fake() -> FakeGateway:
    """A local OpenAI-compatible server on 127.0.0.1 (tests/fake_gateway.py) for the gateway route."""
    gateway = FakeGateway().start()
    yield gateway
    gateway.stop()


def statistics_after(client: TritonClient, model: str, before: dict, inferences: int, timeout_s: float = 30) -> dict:
    """``model``'s statistics once they count ``inferences`` more than ``before`` (or the time-out):
    Triton records an execution after execute returns, which can be after the clients have their
    responses."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = client.statistics(model)["model_stats"][0]
        if int(after["inference_count"]) - int(before["inference_count"]) >= inferences or time.monotonic() > deadline:
            return after
        time.sleep(0.1)
