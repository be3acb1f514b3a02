"""make soak: mixed traffic over every pipeline for a bounded time (default 10 minutes), with hostile
requests mixed in and three faults injected, then docs/reliability.md.

    python -m benchmarks.soak [--seconds 600] [--report docs/reliability.md]

Traffic (one thread each, its own client): text_embedding (gRPC, 2 threads), text_classification
(HTTP), image_classification (gRPC), speech_recognition (gRPC), the router (self-hosted and gateway
tasks; the gateway is a local fake answering in 50 ms) and a hostile client (bad inputs, oversized
and crashing bodies, control API calls, nested router payloads) whose requests must be refused; a
second one sends issue 33's attack classes (``soak_attacks.py``), each also to be refused.

Faults: at 40% of the run eight gateway calls hang for 30 s (router → text_classification p99 is
compared with the 30 s before); at 55% the nginx master is killed with SIGKILL (the launcher starts
a new one; requests of the next 10 s may fail); at 70% the image_preprocess stub is killed (the
watchdog reloads it; only image requests of that window may fail).

Every 10 s: RSS of each process (tritonserver, each model's stubs, nginx, the launcher) and the
/dev/shm bytes of each model's regions."""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import grpc as grpc_module
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from triton_pipelines.client import InferenceServerException, TritonClient, text_tensor
from triton_pipelines.server.launcher import start_on_free_ports
from triton_pipelines.server.processes import SHM_DIR, child_pids, find_stubs

from .perf import markdown_table
from .soak_attacks import Refused, attacks as round3_attacks

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
SAMPLE_S = 10


@dataclass
class Record:
    at: float  # seconds since start
    pipeline: str
    latency_s: float
    outcome: str  # ok | refused (hostile, as expected) | failed
    error: str = ""  # a failure's message


class Soak:
    def __init__(self, server, seconds: float):
        self.server = server
        self.seconds = seconds
        self.start = time.monotonic()
        self.stop = threading.Event()
        self.records: list[Record] = []
        self.samples: list[dict] = []
        self.events: list[tuple[float, str]] = []
        self.lock = threading.Lock()
        self.jpeg = (DATA / "scene.jpg").read_bytes()
        self.wav = (DATA / "speech_hello.wav").read_bytes()

    def now(self) -> float:
        return time.monotonic() - self.start

    def record(self, pipeline: str, call, expect_refusal: bool = False) -> None:
        started = time.monotonic()
        message = ""
        try:
            call()
            outcome = "failed" if expect_refusal else "ok"
            message = "not refused" if expect_refusal else ""
        except (Refused, InferenceServerException, urllib.error.URLError, OSError, grpc_module.RpcError) as error:
            outcome = "refused" if expect_refusal else "failed"
            if outcome == "failed":
                message = str(error)[:200]
                with self.lock:
                    self.events.append((self.now(), f"{pipeline}: {message[:160]}"))
        with self.lock:
            self.records.append(Record(started - self.start, pipeline, time.monotonic() - started, outcome, message))

    # --------------------------------------------------------------------------------- traffic
    def loop(self, pipeline: str, protocol: str, make_call) -> None:
        client = TritonClient(protocol, self.server.url(protocol))
        call = make_call(client)
        while not self.stop.is_set():
            self.record(pipeline, call)
        client.close()

    def router_payload(self, i: int) -> tuple[str, dict, str]:
        kind = i % 3
        if kind == 0:
            return "text_classification", {"text": f"I was charged twice ({i})"}, "realtime"
        if kind == 1:
            return "image_classification", {"image": base64.b64encode(self.jpeg).decode()}, "batch"
        return "general_llm", {"text": f"summarize case {i}", "tier": "cheapest"}, "realtime"

    def router_loop(self) -> None:
        client = TritonClient("grpc", self.server.grpc_url)
        i = 0
        while not self.stop.is_set():
            task, payload, latency_class = self.router_payload(i)
            self.record(f"router:{task}", lambda: client.infer("router", {
                "task": text_tensor([task]), "payload": text_tensor([json.dumps(payload)]),
                "latency_class": text_tensor([latency_class])}))
            i += 1
        client.close()

    def hostile_loop(self) -> None:
        http = f"http://{self.server.http_url}"
        grpc = TritonClient("grpc", self.server.grpc_url)

        def post(path, body, headers=None):
            request = urllib.request.Request(http + path, data=body, method="POST", headers=headers or {})
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.read()

        one_text = [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["hi"]}]
        from tests.support import hostile_files

        progressive = hostile_files.progressive_jpeg(scans=20_000)
        rle_bmp = hostile_files.bmp_rle8_early_row_ends()
        one_hertz = hostile_files.wav(rate=1, frames=300)

        def image_input():
            tensor = grpcclient.InferInput("image", [1, 1], "BYTES")
            tensor.set_data_from_numpy(text_tensor([self.jpeg]))
            return tensor

        def gzip_infer():
            """1 MiB of zeros in ~1 KB of gzip: Triton would inflate it."""
            with grpc_module.insecure_channel(self.server.grpc_url, compression=grpc_module.Compression.Gzip) as channel:
                request = service_pb2.ModelInferRequest(model_name="text_embedding")
                request.inputs.add(name="text", datatype="BYTES").shape.extend([1, 1])
                request.raw_input_contents.append((2**20).to_bytes(4, "little") + bytes(2**20))
                service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)

        attacks = [
            lambda: post("/v2/models/text_embedding/infer", json.dumps({"id": "x" * 4_200_000, "inputs": []}).encode()),
            lambda: post("/v2/models/text_embedding/infer", b'{"id":' + b"[" * 150_000 + b"]" * 150_000 + b"}"),
            lambda: post("/v2/repository/models/evil/load", b"{}"),
            lambda: grpc.client.unload_model("text_embedding"),
            lambda: grpc.infer("text_embedding", {"text": text_tensor([b"\xff\xfe bad utf-8"])}),
            lambda: grpc.infer("image_classification", {"image": text_tensor([b"not an image"])}),
            lambda: grpc.infer("router", {"task": text_tensor(["text_classification"]),
                                          "payload": text_tensor(['{"text": ' + "[" * 50_000 + "]" * 50_000 + "}"])}),
            lambda: grpc.infer("speech_recognition", {"audio": text_tensor([b"RIFF....WAVEfmt "])}),
            # Issue 19's one-request crashers and bypasses (front/screen.py, front/nginx_config.py): each must be refused
            # while tritonserver keeps running (the report counts its restarts).
            lambda: post("/v2/models/text_classification/infer", json.dumps({"inputs": one_text, "outputs": [
                {"name": "label", "parameters": {"classification": 1}}]}).encode()),
            lambda: grpc.client.infer("image_classification", [image_input()], outputs=[
                grpcclient.InferRequestedOutput("labels", class_count=1)]),
            lambda: post("/v2/models/text_embedding/infer", b'{"id":' + b"[" * 131_066),
            lambda: post("/v2/models/text_embedding/infer", b"", {"Content-Length": "0"}),
            lambda: post("/v2/models/text_embedding/infer", json.dumps({"inputs": [
                {**one_text[0], "shape": [4294967297, 1]}]}).encode()),
            lambda: post("/v2/models/whisper_decoder/infer", json.dumps({"inputs": one_text}).encode()),
            lambda: post("/v2/models/" + "m" * 8000 + "/infer", b"{}"),
            lambda: gzip_infer(),
            # cheap to send, costly to decode (image_budget.py, speech/audio.py)
            lambda: grpc.infer("image_classification", {"image": text_tensor([progressive])}),
            lambda: grpc.infer("image_classification", {"image": text_tensor([rle_bmp])}),
            lambda: grpc.infer("speech_recognition", {"audio": text_tensor([one_hertz])}),
        ]
        i = 0
        while not self.stop.is_set():
            self.record("hostile", attacks[i % len(attacks)], expect_refusal=True)
            i += 1
            time.sleep(0.2)
        grpc.close()

    def round3_loop(self) -> None:
        """Issue 33's attack classes (soak_attacks.py), one every 0.5 s, each to be refused."""
        calls = round3_attacks(self.server, self.wav)
        i = 0
        while not self.stop.is_set():
            self.record("hostile (round 3)", calls[i % len(calls)], expect_refusal=True)
            i += 1
            time.sleep(0.5)

    # --------------------------------------------------------------------------------- faults
    def hang_gateway(self, fake, hold_s: float = 30) -> None:
        from tests.support.fake_gateway import Reply

        self.events.append((self.now(), "8 gateway calls hang for 30 s"))
        fake.when("hang-for-the-soak", Reply(delay_s=hold_s))
        client = TritonClient("grpc", self.server.grpc_url)
        threads = [threading.Thread(target=self.record, args=("router:general_llm (hung)", lambda: client.infer(
            "router", {"task": text_tensor(["general_llm"]),
                       "payload": text_tensor(['{"text": "hang-for-the-soak"}'])})))
            for _ in range(8)]
        for t in threads:
            t.start()
        self.hung_window = (self.now(), self.now() + hold_s)
        for t in threads:
            t.join()

    def kill_nginx(self) -> None:
        """kill -9 of nginx's master: its workers die with it (process group, issue 33 §3) and the
        launcher starts a new one; requests of the next 10 s may fail (counted apart)."""
        pid = self.server.proxy.process.pid
        self.nginx_window = (self.now(), self.now() + 10)
        self.events.append((self.now(), f"kill -9 of the nginx master (pid {pid})"))
        os.kill(pid, signal.SIGKILL)

    def kill_stub(self) -> None:
        (stub,) = [s for s in find_stubs(self.server.process.pid) if s.model == "image_preprocess"]
        self.kill_window = (self.now(), self.now() + 15)
        self.events.append((self.now(), f"kill -9 of the image_preprocess stub (pid {stub.pid})"))
        os.kill(stub.pid, signal.SIGKILL)

    # --------------------------------------------------------------------------------- sampling
    def sample(self) -> None:
        sample = {"at": self.now(), "rss": defaultdict(int), "shm": defaultdict(int)}
        triton = self.server.process.pid
        sample["rss"]["tritonserver"] = rss(triton)
        sample["rss"]["launcher (python)"] = rss(os.getpid())
        proxy = self.server.proxy.process.pid
        sample["rss"]["nginx"] = rss(proxy) + sum(rss(p) for p in child_pids(proxy))
        sample["rss"]["request screen"] = sum(rss(r.screen.pid) for r in self.server.replicas)
        for stub in find_stubs(triton):
            sample["rss"][f"stub {stub.model}"] += rss(stub.pid)
            sample["shm"][stub.model] += (SHM_DIR / stub.shm_region).stat().st_size \
                if (SHM_DIR / stub.shm_region).exists() else 0
        self.samples.append(sample)

    def run(self, fake) -> None:
        workers = [
            threading.Thread(target=self.loop, args=("text_embedding", "grpc", lambda c: lambda: c.infer(
                "text_embedding", {"text": text_tensor(["where is my parcel?", "reset my password"])}))),
            threading.Thread(target=self.loop, args=("text_embedding", "grpc", lambda c: lambda: c.infer(
                "text_embedding", {"text": text_tensor(["a longer sentence about a refund " * 6])}))),
            threading.Thread(target=self.loop, args=("text_classification", "http", lambda c: lambda: c.infer(
                "text_classification", {"text": text_tensor(["I want to cancel my subscription"])}))),
            threading.Thread(target=self.loop, args=("image_classification", "grpc", lambda c: lambda: c.infer(
                "image_classification", {"image": text_tensor([self.jpeg])}))),
            threading.Thread(target=self.loop, args=("speech_recognition", "grpc", lambda c: lambda: c.infer(
                "speech_recognition", {"audio": text_tensor([self.wav]),
                                       "max_new_tokens": np.array([[32]], np.int32)}))),
            threading.Thread(target=self.router_loop),
            threading.Thread(target=self.router_loop),
            threading.Thread(target=self.hostile_loop),
            threading.Thread(target=self.round3_loop),
        ]
        for worker in workers:
            worker.start()
        faults = [(0.4, lambda: threading.Thread(target=self.hang_gateway, args=(fake,)).start()),
                  (0.55, self.kill_nginx), (0.7, self.kill_stub)]
        next_sample = 0.0
        while self.now() < self.seconds:
            if self.now() >= next_sample:
                self.sample()
                next_sample += SAMPLE_S
            while faults and self.now() >= faults[0][0] * self.seconds:
                faults.pop(0)[1]()
            time.sleep(0.2)
        self.sample()
        self.stop.set()
        for worker in workers:
            worker.join()
        metrics = urllib.request.urlopen(self.server.metrics_url, timeout=10).read().decode()
        self.triton_restarts = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                                   if line.startswith("launcher_tritonserver_restarts_total"))


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def p99_ms(values) -> float:
    values = list(values)  # a generator is truthy even when empty
    return float(np.percentile(values, 99)) * 1000 if values else float("nan")


def report(soak: Soak, seconds: float) -> str:
    records = soak.records
    kill = getattr(soak, "kill_window", (0, 0))
    nginx = getattr(soak, "nginx_window", (0, 0))
    in_kill_window = lambda r: kill[0] <= r.at <= kill[1]  # noqa: E731
    # a request in flight when nginx was killed (started before, ended after) fails with it too
    in_nginx_window = lambda r: r.at <= nginx[1] and r.at + r.latency_s >= nginx[0]  # noqa: E731
    rows = []
    for pipeline in sorted({r.pipeline for r in records}):
        mine = [r for r in records if r.pipeline == pipeline]
        ok = [r.latency_s for r in mine if r.outcome == "ok"]
        failed = [r for r in mine if r.outcome == "failed"]
        excused = [r for r in failed if (pipeline in ("image_classification", "router:image_classification")
                                         and in_kill_window(r)) or in_nginx_window(r)]
        rows.append([pipeline, len(mine), len(ok), sum(r.outcome == "refused" for r in mine),
                     len(failed) - len(excused), len(excused),
                     f"{statistics.median(ok) * 1000:.1f}" if ok else "-", f"{p99_ms(ok):.1f}" if ok else "-"])
    totals = defaultdict(int)
    for r in records:
        totals[r.outcome] += 1
    minutes = int(seconds // 60) or 1
    over_time = []
    for minute in range(minutes + 1):
        window = [r for r in records if minute * 60 <= r.at < (minute + 1) * 60 and r.outcome == "ok"
                  and not r.pipeline.startswith("hostile")]
        if window:
            over_time.append([minute, len(window)] + [f"{p99_ms(r.latency_s for r in window if r.pipeline == p):.0f}"
                                                      for p in ("text_embedding", "image_classification",
                                                                "speech_recognition", "router:text_classification")])
    first, last = soak.samples[0], soak.samples[-1]
    memory = [[name, f"{first['rss'].get(name, 0) / 2**20:.0f}", f"{last['rss'].get(name, 0) / 2**20:.0f}",
               f"{max(s['rss'].get(name, 0) for s in soak.samples) / 2**20:.0f}"] for name in sorted(last["rss"])]
    shm = [[name, f"{first['shm'].get(name, 0) / 2**20:.0f}", f"{last['shm'].get(name, 0) / 2**20:.0f}",
            f"{max(s['shm'].get(name, 0) for s in soak.samples) / 2**20:.0f}"] for name in sorted(last["shm"])]
    hung = getattr(soak, "hung_window", None)
    gateway_line = ""
    if hung:
        routed = [r for r in records if r.pipeline == "router:text_classification" and r.outcome == "ok"]
        before = [r.latency_s for r in routed if hung[0] - 30 <= r.at < hung[0]]
        during = [r.latency_s for r in routed if hung[0] <= r.at < hung[1]]
        gateway_line = (f"- **Hung gateway**: with 8 gateway calls hanging for 30 s, router → text_classification "
                        f"answered {len(during)} requests with p99 {p99_ms(during):.1f} ms (p50 "
                        f"{statistics.median(during) * 1000:.1f} ms) against p99 {p99_ms(before):.1f} ms (p50 "
                        f"{statistics.median(before) * 1000:.1f} ms) in the 30 s before.\n" if before and during else "")
    # The calls to the hung gateway are meant to fail at their deadline: the fault, not a failure of ours.
    hung_failed = [r for r in records if r.pipeline.endswith("(hung)") and r.outcome == "failed"]
    unexpected = sum(row[4] for row in rows if not row[0].endswith("(hung)"))
    if hung_failed:
        gateway_line += (f"  The {len(hung_failed)} calls to the hung gateway failed at their deadline "
                         f"(UNAVAILABLE after {statistics.median(r.latency_s for r in hung_failed):.1f} s), as designed.\n")
    kill_failures = [r.at for r in records if r.outcome == "failed" and in_kill_window(r)]
    nginx_failures = [r.at for r in records if r.outcome == "failed" and in_nginx_window(r)]
    recovery = (f" The last failure of that window came {max(kill_failures) - kill[0]:.0f} s after the kill."
                if kill_failures else " No request failed.")
    # the killed nginx's window fails every request in flight or sent then: counted above, not listed
    listed = [(at, text) for at, text in soak.events if not nginx[0] < at <= nginx[1] + 1]
    events = "\n".join(f"- {at:.0f} s: {text}" for at, text in listed[:40])
    unexpected_rows = [r for r in records if r.outcome == "failed" and not r.pipeline.endswith("(hung)")
                       and not in_nginx_window(r)
                       and not (r.pipeline in ("image_classification", "router:image_classification") and in_kill_window(r))]
    unexpected_list = "\n".join(f"- {r.at:.0f} s (+{r.latency_s:.1f} s) {r.pipeline}: {r.error}"
                                 for r in unexpected_rows[:20]) or "- none"
    return f"""# Reliability: soak run

Written by `make soak` (`python -m benchmarks.soak --seconds {seconds:.0f}`): {seconds / 60:.0f} minutes of mixed
traffic over every pipeline through the public ports, two hostile clients mixed in (issue 19's
one-request crashers and issue 33's attack classes: benchmarks/soak_attacks.py), and three injected
faults. One run on one machine ({os.cpu_count()} cores, shared: latencies include other work on it).

## Summary

- {len(records)} requests: {totals['ok']} answered, {totals['refused']} hostile requests refused as they should be,
  **{unexpected} unexpected failures** (the killed stub's window and the hung gateway's calls apart),
  **{soak.triton_restarts:.0f} restarts of tritonserver** (the hostile client's one-request crashers included).
{gateway_line}- **Killed nginx**: the nginx master was killed with SIGKILL at {nginx[0]:.0f} s; the launcher started a
  new one. {len(nginx_failures)} requests failed in the 10 s after it (counted apart){
  f", the last {max(nginx_failures) - nginx[0]:.0f} s after the kill" if nginx_failures else ""}.
- **Killed stub**: image_preprocess's stub was killed at {kill[0]:.0f} s; the image requests that failed
  in the 15 s after it are counted apart (the watchdog reloads the model within seconds).{recovery}

## Requests per pipeline

{markdown_table(["pipeline", "requests", "answered", "refused (hostile)", "failed", "failed in the kill window",
                 "p50 ms", "p99 ms"], rows)}

## p99 (ms) per minute

{markdown_table(["minute", "answered", "text_embedding", "image_classification", "speech_recognition",
                 "router → text_classification"], over_time)}

## Memory: RSS per process (MiB) — first sample, last sample, peak

{markdown_table(["process", "first", "last", "peak"], memory)}

## /dev/shm per model (MiB) — first sample, last sample, peak

{markdown_table(["model", "first", "last", "peak"], shm)}

## Unexpected failures

{unexpected_list}

## Events

{events or "- none"}
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=float(os.environ.get("SOAK_SECONDS", 600)))
    parser.add_argument("--report", type=Path, default=ROOT / "docs" / "reliability.md")
    args = parser.parse_args(argv)
    from tests.support.fake_gateway import FakeGateway, Reply

    fake = FakeGateway().start()
    fake.default = Reply(delay_s=0.05)
    os.environ.update(LLM_GATEWAY_BASE_URL=fake.base_url, LLM_GATEWAY_API_KEY="sk-soak-" + os.urandom(8).hex())
    repository = Path(os.environ.get("SOAK_MODEL_REPOSITORY", ROOT / "model_repository"))
    server = start_on_free_ports(repository, ROOT / ".cache" / "soak-server.log", response_cache_bytes=0)
    try:
        soak = Soak(server, args.seconds)
        soak.run(fake)
    finally:
        server.stop()
        fake.stop()
    args.report.write_text(report(soak, args.seconds))
    print(f"wrote {args.report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
