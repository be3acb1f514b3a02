"""The embedded launcher: ports, readiness, and a clean stop that lets in-flight requests finish."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from triton_pipelines.client import TritonClient, text_tensor
from triton_pipelines.server.launcher import start_on_free_ports

from tests.conftest import LOG_DIR, ensure_repository



TEXT_EMBEDDING_MODELS = ["text_tokenizer", "text_encoder", "text_embedding"]


def test_sigterm_lets_in_flight_requests_finish():
    """SIGTERM while requests are in flight: each gets its answer, then the server exits 0."""
    server = start_on_free_ports(ensure_repository(), LOG_DIR / "shutdown-server.log",
                                 models=TEXT_EMBEDDING_MODELS)
    long_text = " ".join(["an order that arrived late and damaged"] * 30)
    clients = [TritonClient("grpc", server.grpc_url) for _ in range(6)]
    started = threading.Barrier(7)

    def call(i):
        started.wait()
        return clients[i].infer("text_embedding", {"text": text_tensor([long_text] * 4)})["embedding"]

    try:
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(call, i) for i in range(6)]
            started.wait()
            time.sleep(0.3)  # the requests are queued or executing
            assert server.process.poll() is None
            code = server.stop()
            results = [f.result(timeout=120) for f in futures]
    finally:
        server.stop()
        for c in clients:
            c.close()
    assert code == 0
    assert all(r.shape == (4, 384) and np.isfinite(r).all() for r in results)


def test_a_model_that_fails_to_load_stops_the_start(tmp_path):
    """A broken repository is reported at start, not discovered by the first request."""
    broken = tmp_path / "repo"
    (broken / "broken" / "1").mkdir(parents=True)
    (broken / "broken" / "config.pbtxt").write_text('name: "broken"\nbackend: "python"\n')
    (broken / "broken" / "1" / "model.py").write_text("raise ImportError('deliberately broken')\n")
    with pytest.raises(RuntimeError, match="exited"):
        start_on_free_ports(broken, tmp_path / "log", timeout_s=120)


class FakeUpstream(http.server.BaseHTTPRequestHandler):
    """A quiet upstream for nginx tests; subclasses answer with ``answer``."""
    protocol_version = "HTTP/1.1"

    def answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def proxy_in_front_of(handler, state_dir: Path, **config):
    """nginx (``ProxyProcess``) on free ports in front of a ``ThreadingHTTPServer`` running
    ``handler`` for every upstream (Triton HTTP, gRPC and status): (proxy, upstream, HTTP port)."""
    from triton_pipelines.server.launcher import free_ports
    from triton_pipelines.front.nginx_config import ProxyConfig
    from triton_pipelines.server.nginx_process import ProxyProcess

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    http_port, grpc_port, metrics_port = free_ports(3)
    proxy = ProxyProcess(ProxyConfig(listen_address="127.0.0.1", http_port=http_port, grpc_port=grpc_port,
                                     metrics_port=metrics_port, triton_http_ports=(upstream.server_port,),
                                     triton_grpc_ports=(upstream.server_port,), status_port=upstream.server_port,
                                     screen_http_ports=(upstream.server_port,),
                                     screen_grpc_ports=(upstream.server_port,),
                                     state_dir=state_dir, **config))
    return proxy, upstream, http_port


def wait_for_front(proxy, http_port: int, timeout_s: float = 30) -> None:
    """Until nginx answers health on ``http_port`` (a loaded 2-core machine has taken over 10 s once,
    in a full run); failing, says whether nginx is alive and what holds the port."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/live", timeout=2).read()
            return
        except (urllib.error.URLError, ConnectionError) as error:
            if time.monotonic() > deadline:
                listening = subprocess.run(["ss", "-ltnp", f"sport = :{http_port}"], capture_output=True,
                                           text=True).stdout
                raise AssertionError(f"nginx not answering on {http_port} after {timeout_s:g} s ({error}); "
                                     f"alive: {proxy.alive()} (exit {proxy.process.poll()}); {listening}") from None
            time.sleep(0.1)


@pytest.mark.skipif(os.geteuid() != 0, reason="nginx switches its workers to another user only when started as root")
def test_large_bodies_pass_when_the_state_folder_is_private(tmp_path):
    """Started as root, nginx's workers run as nobody: bodies over their 1 MiB buffer go to temp
    files, which must be reachable even when the state folder sits under a private one (/root,
    pytest's 0700 temp folders). A 5 MB body reaches the upstream."""
    import urllib.request

    class Upstream(FakeUpstream):
        def do_POST(self):
            length = len(self.rfile.read(int(self.headers["Content-Length"])))
            self.answer(json.dumps({"received": length}).encode())

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    proxy, upstream, http_port = proxy_in_front_of(Upstream, private / "state" / "proxy", run_as="nobody nogroup")
    try:
        temp = proxy.temp_dir
        assert not str(temp).startswith(str(private)) and (temp / "client_body").owner() == "nobody"
        body = b"0" * 5_000_000
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/models/m/infer", data=body,
                                         headers={"Inference-Header-Content-Length": "2"})
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    assert json.loads(response.read()) == {"received": len(body)}
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            except urllib.error.URLError as error:
                if not isinstance(error.reason, ConnectionRefusedError) or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        proxy.stop()
        upstream.shutdown()
    assert not temp.exists()


def test_the_front_refuses_inference_beyond_its_in_flight_limit_at_once(tmp_path):
    """max_inflight=2 in front of an upstream that takes 1.5 s: of 5 concurrent inference requests
    (binary and JSON bodies) 2 are served and 3 refused at once with 503, a JSON error and
    Retry-After, before their bodies reach the upstream; health answers meanwhile; a JSON request
    (an internal rewrite) counts once."""
    import urllib.request

    from triton_pipelines.front.nginx_config import default_worker_user

    reached = []

    class SlowUpstream(FakeUpstream):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            reached.append(self.path)
            time.sleep(1.5)
            self.answer(b'{"ok": true}')

        def do_GET(self):
            self.answer(b"")

    proxy, upstream, http_port = proxy_in_front_of(SlowUpstream, tmp_path / "proxy", max_inflight=2,
                                                   run_as=default_worker_user())
    base = f"http://127.0.0.1:{http_port}"

    def infer(json_body: bool):
        headers = {} if json_body else {"Inference-Header-Content-Length": "2"}
        request = urllib.request.Request(f"{base}/v2/models/m/infer", data=b"{}" + b"0" * 1000, headers=headers)
        started = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, time.monotonic() - started, response.read(), None
        except urllib.error.HTTPError as error:
            return error.code, time.monotonic() - started, error.read(), error.headers.get("Retry-After")

    try:
        wait_for_front(proxy, http_port)
        assert infer(json_body=True)[0] == 200  # alone: the JSON path's rewrite is not counted twice
        reached.clear()
        with ThreadPoolExecutor(5) as pool:
            first = [pool.submit(infer, json_body=i % 2 == 0) for i in range(2)]
            time.sleep(0.5)  # both are at the upstream
            later = [pool.submit(infer, json_body=i % 2 == 0) for i in range(3)]
            time.sleep(0.1)
            with urllib.request.urlopen(f"{base}/v2/health/live", timeout=2) as health:
                assert health.status == 200  # not an inference request: never refused
            results = [f.result() for f in first + later]
        served = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] != 200]
        assert len(served) == 2 and len(refused) == 3, [(r[0], r[2][:80]) for r in results]
        for status, seconds, body, retry_after in refused:
            assert status == 503 and seconds < 0.5 and retry_after == "1", (status, body)
            assert "limit of 2 inference requests in flight" in json.loads(body)["error"]
        assert len(reached) == 2  # the refused bodies never reached the upstream
    finally:
        proxy.stop()
        upstream.shutdown()


def test_clients_that_send_their_body_slowly_hold_no_in_flight_place(tmp_path):
    """max_inflight=2: two clients that send headers and then dribble their bodies (a slow-loris
    on the limit) do not keep a third, complete request out: HTTP requests are counted only once
    nginx has their whole body."""
    import socket
    import urllib.request

    from triton_pipelines.front.nginx_config import default_worker_user

    class Upstream(FakeUpstream):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.answer(b'{"ok": true}')

        def do_GET(self):
            self.answer(b"")

    proxy, upstream, http_port = proxy_in_front_of(Upstream, tmp_path / "proxy", max_inflight=2,
                                                   run_as=default_worker_user())
    slow = []
    try:
        wait_for_front(proxy, http_port)
        for _ in range(2):
            connection = socket.create_connection(("127.0.0.1", http_port))
            connection.sendall(b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{{")
            slow.append(connection)
        time.sleep(0.5)
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/models/m/infer", data=b"{}")
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200 and json.loads(response.read()) == {"ok": True}
    finally:
        for connection in slow:
            connection.close()
        proxy.stop()
        upstream.shutdown()


def test_cli_serves_on_environment_ports_and_stops_cleanly_on_ctrl_c():
    import signal
    import subprocess
    import sys
    import urllib.request

    from triton_pipelines.server.launcher import free_ports

    http, grpc, metrics = free_ports(3)
    env = dict(os.environ, TRITON_HTTP_PORT=str(http), TRITON_GRPC_PORT=str(grpc), TRITON_METRICS_PORT=str(metrics))
    log = open(LOG_DIR / "cli-server.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "triton_pipelines", "serve", "--model-repository", str(ensure_repository()),
         "--load-model", "text_tokenizer"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            if "Triton is ready" in (LOG_DIR / "cli-server.log").read_text(errors="replace"):
                break
            time.sleep(0.5)
        assert urllib.request.urlopen(f"http://localhost:{http}/v2/health/ready", timeout=5).status == 200
        assert urllib.request.urlopen(f"http://localhost:{metrics}/metrics", timeout=5).status == 200
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
        assert process.wait(timeout=90) == 0
    finally:
        if process.poll() is None:
            process.kill()
    server_log = (LOG_DIR / "cli-server.log").read_text(errors="replace")
    # The launcher drained (unloaded the models) and then stopped Triton with SIGTERM; Triton never
    # saw the Ctrl-C itself.
    assert "successfully unloaded 'text_tokenizer'" in server_log
    assert "Signal (15) received" in server_log and "Signal (2) received" not in server_log


def test_a_killed_nginx_master_leaves_no_worker_holding_the_ports(tmp_path):
    """kill -9 of nginx's master leaves its workers running, on the old configuration, holding the
    public ports: a restart must reap them, or every new master fails to bind (issue 33 §3)."""
    import signal
    import urllib.error
    import urllib.request

    from triton_pipelines.server.processes import group_pids

    class Upstream(FakeUpstream):
        def do_GET(self):
            self.answer(b"ok")

    def ready(url: str, timeout_s: float = 10) -> int:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return urllib.request.urlopen(url, timeout=5).status
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    proxy, upstream, http_port = proxy_in_front_of(Upstream, tmp_path / "proxy")
    try:
        url = f"http://127.0.0.1:{http_port}/v2/health/ready"
        assert ready(url) == 200
        old_master = proxy.process.pid
        workers = [pid for pid in group_pids(old_master) if pid != old_master]
        assert workers, "nginx runs workers in its master's process group"
        os.kill(old_master, signal.SIGKILL)
        proxy.process.wait()
        assert all(pid in group_pids(old_master) for pid in workers)  # orphaned, still holding the ports
        proxy.restart()
        assert not group_pids(old_master), "a worker of the killed master is still running"
        assert ready(url) == 200
        assert proxy.alive(), "the new master could not start (the ports still held?)"
    finally:
        proxy.stop()
        upstream.shutdown()
