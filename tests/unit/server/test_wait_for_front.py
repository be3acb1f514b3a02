"""The launcher's wait for its public port (``launcher.wait_for_front``): nginx that dies while the
server starts is restarted, as the supervisor does once serving; one that keeps dying stops the
start with its exit code named. A loopback HTTP server stands in for the port."""

from __future__ import annotations

import http.server
import threading

import pytest

from triton_pipelines.server.launcher import START_FRONT_RESTARTS, wait_for_front


class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class FakeProxy:
    """Dead at first; ``restart`` brings the port up after ``deaths`` restarts."""

    def __init__(self, deaths: int):
        self.deaths, self.restarts, self.server = deaths, 0, None
        self.process = type("Process", (), {"returncode": -6})()

    def alive(self) -> bool:
        return self.server is not None

    def restart(self) -> None:
        self.restarts += 1
        if self.restarts >= self.deaths:
            self.server = http.server.ThreadingHTTPServer(("127.0.0.1", PORT), Ready)
            threading.Thread(target=self.server.serve_forever, daemon=True).start()


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


PORT = free_port()


def test_a_front_that_died_while_starting_is_restarted_and_said_so():
    proxy, said = FakeProxy(deaths=1), []
    try:
        wait_for_front(f"127.0.0.1:{PORT}", proxy, said.append, window_s=10)
    finally:
        if proxy.server:
            proxy.server.shutdown()
            proxy.server.server_close()
    assert proxy.restarts == 1 and said == ["nginx exited with code -6 while the server started; restarting it"]


def test_a_front_that_keeps_dying_stops_the_start_naming_its_exit_code():
    proxy, said = FakeProxy(deaths=99), []
    with pytest.raises(RuntimeError, match=rf"nginx exited with code -6 \({START_FRONT_RESTARTS + 1} times"):
        wait_for_front(f"127.0.0.1:{free_port()}", proxy, said.append, window_s=10)
    assert proxy.restarts == START_FRONT_RESTARTS
