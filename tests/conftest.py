"""Fixtures: the real embedded Triton server, started once per session on free ports, and clients
for both protocols.

The repository is the one `make repository` builds (`make test` builds it first); if it is missing
the fixture builds it. `TEST_MODEL_REPOSITORY=DIR` points the tests at another built repository
(e.g. one built with `--pipelines text`). `TEST_SERVER_STATE=DIR` attaches the tests to a launcher that
is already running (its state folder), e.g. the Python 3.10 rehearsal of the container
(tests/unit/deploy/test_images.py). Server logs go to `.cache/test-server.log`.

Tests mirror the layers: `tests/unit/<layer>/` needs no server, `tests/server/` starts or uses one
and is marked `server` by folder (`pytest_collection_modifyitems`; a server test outside it is a
collection error). `make test-unit` (`pytest -m "not server"`) runs the rest; `tests/support/` holds
the fakes and helpers.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import time
from pathlib import Path

import pytest

from triton_pipelines.client import TritonClient
from triton_pipelines.server.launcher import RunningServer, start_on_free_ports

from tests.support.fake_gateway import FakeGateway
from tests.support.paths import PROJECT_ROOT

# Fixtures shared by folders that do not import each other.
pytest_plugins = ["tests.support.builder_wheel"]

MODEL_REPOSITORY = Path(os.environ.get("TEST_MODEL_REPOSITORY", PROJECT_ROOT / "model_repository")).resolve()
LOG_DIR = PROJECT_ROOT / ".cache"


# Fixtures that are (or hold) a running server. A module's own fixtures and helpers that start one are
# found by their source (STARTS_A_SERVER), as are test bodies that start one themselves.
SERVER_FIXTURES = frozenset({"triton_server", "compute_server", "client", "http_client", "internal_client"})
STARTS_A_SERVER = re.compile(r"Popen\(\s*\[[^\]]*\"triton_pipelines\", \"serve\"|start_on_free_ports\(|Launcher\(|ProxyProcess\(|RunningServer\("
                             r"|[\"']triton_pipelines\.launcher[\"']")


def _starts_a_server(function, starters: frozenset[str]) -> bool:
    """Whether ``function``'s source starts a server, directly or through one of ``starters`` (the
    names of its module's functions that do)."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    return bool(STARTS_A_SERVER.search(source)) or any(re.search(rf"\b{name}\(", source) for name in starters)


def _module_starters(module) -> frozenset[str]:
    """Names of ``module``'s plain functions that start a server, directly or through one another."""
    functions = {name: value for name, value in vars(module).items()
                 if inspect.isfunction(value) and getattr(value, "__module__", None) == module.__name__
                 and not hasattr(value, "_pytestfixturefunction")}  # fixtures: through the closure
    starters: set[str] = set()
    while True:
        found = {name for name, function in functions.items()
                 if name not in starters and _starts_a_server(function, frozenset(starters))}
        if not found:
            return frozenset(starters)
        starters |= found


def needs_server(item: pytest.Item, starters: frozenset[str]) -> bool:
    if item.get_closest_marker("server"):
        return True
    info = getattr(item, "_fixtureinfo", None)
    for name in item.fixturenames:
        if name in SERVER_FIXTURES:
            return True
        for definition in (info.name2fixturedefs.get(name, ()) if info else ()):
            if _starts_a_server(definition.func, starters):
                return True
    function = getattr(item, "function", None)
    return function is not None and _starts_a_server(function, starters)


SERVER_TESTS = Path(__file__).resolve().parent / "server"


def pytest_collection_modifyitems(config, items):
    """Server tests are found by folder: everything under tests/server/ is marked ``server``; a test
    elsewhere that starts or uses a server is a collection error (it belongs in tests/server/)."""
    starters: dict[str, frozenset[str]] = {}
    misplaced = []
    for item in items:
        if SERVER_TESTS in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.server)
            continue
        module = getattr(item, "module", None)
        if module is not None and module.__name__ not in starters:
            starters[module.__name__] = _module_starters(module)
        if needs_server(item, starters.get(module.__name__, frozenset()) if module else frozenset()):
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError("tests that start or use a server belong in tests/server/: " + ", ".join(misplaced))


def ensure_repository() -> Path:
    if not (MODEL_REPOSITORY / ".built").exists():
        from repo_builder.__main__ import main as build

        build(["--target", "embedded", "--output", str(MODEL_REPOSITORY)])
    return MODEL_REPOSITORY


def image_classifier(repository: Path | None = None) -> str:
    """The compute model that the built repository's image_classification runs, its nested
    image_logits' second step (the builder names it for --image-model: efficientnet_lite0 by default)."""
    from repo_builder.files import read_config

    config = read_config((repository or ensure_repository()) / "image_logits" / "config.pbtxt")
    return config.ensemble_scheduling.step[1].model_name


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
                                 models=["text_encoder", image_classifier(), "whisper_encoder", "whisper_decoder"],
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
def environment(**values: str):
    """Environment variables for servers started inside the block (the router reads them at
    load); the test process's own values are restored after."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def gateway_environment(base_url: str, key: str):
    """LLM_GATEWAY_BASE_URL / LLM_GATEWAY_API_KEY for a server started inside the block."""
    return environment(LLM_GATEWAY_BASE_URL=base_url, LLM_GATEWAY_API_KEY=key)


@pytest.fixture(scope="module")
def fake() -> FakeGateway:
    """A local OpenAI-compatible server on 127.0.0.1 (tests/support/fake_gateway.py) for the gateway route."""
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


@pytest.fixture(scope="session")
def postgres_server():
    """A PostgreSQL server of its own (tests/support/postgres_server.py), for the spend ledger's tests."""
    from tests.support.postgres_server import PostgresServer

    server = PostgresServer()
    yield server
    server.stop()


# A failed server test reports what the servers logged while it ran: CI keeps only the test output,
# and a server that crashed (a signal, an abort) says so only in its log.
LOG_TAIL_LINES = 60


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed or item.get_closest_marker("server") is None:
        return
    started = time.time() - (call.duration or 0) - 5
    for log in sorted(LOG_DIR.glob("*.log")):
        try:
            if log.stat().st_mtime < started:
                continue
            lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        except OSError:
            continue
        report.sections.append((f"server log {log.name} (last {len(lines)} lines)", "\n".join(lines)))
