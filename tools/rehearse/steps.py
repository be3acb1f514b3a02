"""The run steps of `make rehearse` (see rehearse.py): the cpu profile end to end through Docker
Compose v2 against podman, then the gpu profile as far as a machine without a GPU allows."""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
import urllib.error
import urllib.request
from pathlib import Path

from triton_pipelines.repository.contract import BuiltManifest
from tools.rehearse.recipes import (CLEANUP_STEP, NO_GPU_OVERRIDE, TARGET_IMAGES, TRITON_MODULES, copy_tree, free_port,
                       run, server_imports)

# Served through the public ports in the cpu profile (one request each, HTTP and gRPC).
PIPELINES = ("text_embedding", "text_classification", "image_classification", "speech_recognition")
# The espeak-ng sentence Whisper base must transcribe with a word error rate of at most MAX_WER.
SENTENCE = "Please send the report to my office before noon."
MAX_WER = 0.25
# The Whisper the gpu profile's builder exports here (WHISPER_GPU_MODEL): the packaged real base, no
# download; the default, openai/whisper-large-v3, needs ~19.3 GiB to export (docs/operations.md).
REHEARSAL_WHISPER_MODEL = "base"
HEALTH_TIMEOUT_S = 900
# The host as the containers see it (podman writes it into every container's /etc/hosts), and the
# service name the rehearsal's traces carry.
CONTAINER_HOST = "host.containers.internal"
TRACE_SERVICE = "triton-pipelines-rehearsal"
# Every process exports in batches (the SDKs' 5 s schedule delay; tritonserver's too).
TRACE_TIMEOUT_S = 60
# rehearse_check.py's checks, one `check:` line each when they pass.
CHECKS = 4


def unreadable(root: Path) -> list[str]:
    """Paths under ``root`` another user could not read (file) or list and enter (folder)."""
    bad = []
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        if path.is_dir() and (mode & (stat.S_IROTH | stat.S_IXOTH)) != (stat.S_IROTH | stat.S_IXOTH):
            bad.append(str(path.relative_to(root)))
        elif path.is_file() and not mode & stat.S_IROTH:
            bad.append(str(path.relative_to(root)))
    return bad


def http_status(url: str, method: str = "GET", data: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, method=method, data=data)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def config_dict(config_path: Path) -> dict:
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2 as mc

    config = text_format.Parse(config_path.read_text(), mc.ModelConfig())
    return json_format.MessageToDict(config, preserving_proto_field_name=True)


def service_states(rows: list[dict]) -> str:
    return ", ".join(f"{row.get('Service')}: {row.get('State')} {row.get('Status', '')}".strip() for row in rows)


def trace_from_inside(receiver, http_port: int, logfile: Path) -> str:
    """One text_embedding request with a sampled traceparent: its spans from every process inside
    the container (the screen, tritonserver, the stubs) reach the host's receiver as one tree under
    the client's span."""
    from tools.otlp_receiver import EMBEDDING_TREE, describe, missing_spans, tree_problems

    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    body = json.dumps({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES",
                                   "data": [f"traced from inside the container {trace_id}"]}]}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v2/models/text_embedding/infer", data=body,
        headers={"Content-Type": "application/json", "traceparent": f"00-{trace_id}-{span_id}-01"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answered = response.headers.get("x-trace-id")
    if answered != trace_id:
        raise RuntimeError(f"x-trace-id {answered!r}, not the client's {trace_id}")
    spans = receiver.wait_for_trace(trace_id, lambda got: not missing_spans(got, EMBEDDING_TREE),
                                    timeout_s=TRACE_TIMEOUT_S)
    missing, problems = missing_spans(spans, EMBEDDING_TREE), tree_problems(spans, span_id)
    services = {s.service for s in spans}
    if missing or problems or services != {TRACE_SERVICE}:
        raise RuntimeError(f"spans missing {missing}, {problems}, services {sorted(services)} after "
                           f"{TRACE_TIMEOUT_S} s ({receiver.requests} exports received):\n{describe(spans)}")
    with open(logfile, "a") as log:
        log.write(describe(spans) + "\n")
    return (f"{len(spans)} spans from {sorted({s.process for s in spans})} in one tree under the client's "
            f"span, exported from inside the container to {CONTAINER_HOST}")


class Steps:
    def __init__(self, rehearsal):
        self.r = rehearsal
        self.project = f"rehearse{os.getpid()}"
        self.ports = {}
        self.env = None

    def compose(self, *args, tree=None, **kwargs):
        return self.r.compose(tree or self.r.tree, self.project, *args, env=self.env, **kwargs)

    # ------------------------------------------------------------------ cpu profile
    def prepare(self) -> str:
        tree = copy_tree(self.r.root, self.r.workdir / "tree")
        self.r.tree = tree
        seed = self.r.root / "model_repository"
        seeded = ""
        if os.environ.get("REHEARSE_SEED", "1") != "0" and BuiltManifest.exists(seed):
            if BuiltManifest.read(seed).target == "embedded":
                # A cache: the builder service re-checks every model's content hash and rebuilds
                # what differs (`make test` leaves this repository on CI).
                shutil.copytree(seed, tree / "model_repository", symlinks=True, dirs_exist_ok=True)
                seeded = " (model_repository seeded from the checkout's embedded build as a cache)"
        self.env = self.r.start_service()
        self.ports = {"TRITON_HTTP_PORT": free_port(), "TRITON_GRPC_PORT": free_port(),
                      "TRITON_METRICS_PORT": free_port(), "PROMETHEUS_PORT": free_port()}
        self.env.update({k: str(v) for k, v in self.ports.items()}, COMPOSE_PROFILES="cpu")
        # Tracing by the compose file's own variables, to an OTLP receiver on this host that the
        # containers reach by podman's host.containers.internal; ratio 0: only a sampled client
        # parent is traced (cpu_trace's request), nothing else.
        from tools.otlp_receiver import OtlpReceiver

        self.receiver = OtlpReceiver(host="0.0.0.0")
        self.env.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://{CONTAINER_HOST}:{self.receiver.port}",
                        OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG="0",
                        OTEL_SERVICE_NAME=TRACE_SERVICE)
        return f"tree copied to {tree}{seeded}; ports {self.ports}; OTLP receiver on port {self.receiver.port}"

    def cpu_up(self) -> str:
        started = time.monotonic()
        # grafana is left out: no Debian package, no image can be fetched here.
        self.compose("--profile", "cpu", "up", "-d", "--no-build", "repository-builder-cpu", "triton-cpu",
                     "prometheus", timeout=3600)
        built = time.monotonic() - started
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while True:
            rows = self.ps()
            triton = next((row for row in rows if row.get("Service") == "triton-cpu"), None)
            health = (triton or {}).get("Health", "")
            if health == "healthy":
                break
            if triton is not None and triton.get("State") == "running":
                # Podman runs a container's healthcheck from a systemd timer; our machines (and CI)
                # have no systemd, so nothing would ever run it and the state would stay "starting".
                # Run the compose file's own healthcheck command as the timer would (its interval:
                # this loop's 5 s); podman records the result and compose reports it.
                run(["podman", "healthcheck", "run", triton["Name"]], check=False, capture=True)
            builder = next((row for row in rows if row.get("Service") == "repository-builder-cpu"), {})
            # compose starts triton-cpu only once the builder exits 0: after a failure it stays "created".
            builder_failed = builder.get("State") in ("exited", "dead") and builder.get("ExitCode") not in (0, None)
            if triton is None or triton.get("State") in ("exited", "dead") or builder_failed or \
                    time.monotonic() > deadline:
                raise RuntimeError(f"triton-cpu not healthy (state {(triton or {}).get('State')!r}, health "
                                   f"{health!r}); {service_states(rows)}; last lines:\n"
                                   f"{self.tail_logs()}\n(log: compose logs, {self.r.logfile})")
            time.sleep(5)
        user = run(["podman", "exec", triton["Name"], "id", "-u"], capture=True).stdout.decode().strip()
        if user != "1000":
            raise RuntimeError(f"triton-cpu runs as uid {user}, not 1000")
        # `up -d` shows no service output: the builder's goes to the log, its summary to this line.
        logs = self.compose("--profile", "cpu", "logs", "--no-color", "repository-builder-cpu", capture=True,
                            check=False)
        text = (logs.stdout + logs.stderr).decode(errors="replace")
        with open(self.r.logfile, "a") as log:
            log.write(text)
        summary = next((line.split("[repo_builder] ", 1)[1].split(";")[0] for line in text.splitlines()
                        if "[repo_builder] embedded repository at" in line), "builder summary not found")
        return (f"builder service done ({summary}) and triton-cpu up in {built:.0f} s, healthy after "
                f"{time.monotonic() - started:.0f} s, as uid {user}")

    def tail_logs(self, lines: int = 25) -> str:
        """The builder's and the server's last lines, into the failure line (CI keeps no log file)."""
        logs = self.compose("--profile", "cpu", "logs", "--no-color", "--timestamps", "repository-builder-cpu",
                            "triton-cpu", capture=True, check=False, timeout=120)
        text = (logs.stdout + logs.stderr).decode(errors="replace")
        with open(self.r.logfile, "a") as log:
            log.write(text)
        return "\n".join(text.splitlines()[-lines:])

    def ps(self) -> list[dict]:
        out = self.compose("--profile", "cpu", "ps", "-a", "--format", "json", capture=True).stdout.decode()
        out = out.strip()
        if not out:
            return []
        if out.startswith("["):
            return json.loads(out)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def cpu_pipelines(self) -> str:
        import numpy as np

        from triton_pipelines.client import TritonClient, text_tensor
        from tools.photos import PHOTOS, photo_problems
        from tools.speech_eval import speak, word_errors
        from triton_pipelines.server.warmup import sample_inputs

        repository = self.r.tree / "model_repository"
        http = f"127.0.0.1:{self.ports['TRITON_HTTP_PORT']}"
        grpc = f"127.0.0.1:{self.ports['TRITON_GRPC_PORT']}"
        answered = []
        for protocol, url in (("http", http), ("grpc", grpc)):
            client = TritonClient(protocol, url)
            try:
                for name in PIPELINES:
                    inputs = sample_inputs(config_dict(repository / name / "config.pbtxt"))
                    outputs = client.infer(name, inputs)
                    if not outputs:
                        raise RuntimeError(f"{name} over {protocol}: no outputs")
                # Real weights: photos of known content get their ImageNet classes in the top 5.
                def classify(images, client=client):
                    out = client.infer("image_classification", {"image": text_tensor(images)})
                    return out["labels"], out["class_ids"]

                problems = photo_problems(classify)
                if problems:
                    raise RuntimeError(f"image_classification over {protocol}: " + "; ".join(problems))
                audio = speak(SENTENCE)
                out = client.infer("speech_recognition", {"audio": text_tensor([audio]),
                                                          "language": text_tensor(["en"]),
                                                          "task": text_tensor(["transcribe"])})
                transcript = out["transcript"][0, 0].decode()
                wer = word_errors(SENTENCE, transcript).wer
                if wer > MAX_WER:
                    raise RuntimeError(f"Whisper over {protocol}: {transcript!r}, WER {wer:.2f} > {MAX_WER}")
                routed = client.infer("router", {"task": text_tensor(["text_classification"]),
                                                 "payload": text_tensor([json.dumps({"text": "where is my parcel?"})])})
                result = json.loads(routed["result"][0, 0])
                if result.get("route") != "triton":
                    raise RuntimeError(f"router over {protocol}: {result}")
                answered.append(f"{protocol} ({len(PIPELINES)} pipelines + router, {len(PHOTOS)} photos labelled, "
                                f"WER {wer:.2f}: {transcript!r})")
            finally:
                client.close()
        status, _ = http_status(f"http://{http}/v2/repository/index", "POST", b"{}")
        if status != 403:
            raise RuntimeError(f"POST /v2/repository/index answered {status}, not 403")
        status, body = http_status(f"http://127.0.0.1:{self.ports['TRITON_METRICS_PORT']}/metrics")
        families = {line.split("{")[0].split(" ")[0] for line in body.decode().splitlines()
                    if line.startswith("nv_")}
        if status != 200 or not families:
            raise RuntimeError(f"/metrics answered {status} with {len(families)} nv_* families")
        del np
        return "; ".join(answered) + f"; control API 403; /metrics {len(families)} nv_* families"

    def cpu_trace(self) -> str:
        return trace_from_inside(self.receiver, self.ports["TRITON_HTTP_PORT"], self.r.logfile)

    def cpu_prometheus(self) -> str:
        port = self.ports["PROMETHEUS_PORT"]
        deadline = time.monotonic() + 120
        while True:
            status, body = http_status(f"http://127.0.0.1:{port}/api/v1/targets")
            if status == 200:
                targets = json.loads(body)["data"]["activeTargets"]
                up = [t["scrapeUrl"] for t in targets if t["health"] == "up"]
                if up:
                    return f"Prometheus (Debian's 2.42 as prom/prometheus:v2.53.0) scrapes {up}"
            if time.monotonic() > deadline:
                raise RuntimeError(f"Prometheus has no healthy target: {status} {body[:300]!r}")
            time.sleep(5)

    def cpu_down(self) -> str:
        rows = self.ps()
        name = next(row["Name"] for row in rows if row.get("Service") == "triton-cpu")
        started = time.monotonic()
        self.compose("--profile", "cpu", "stop", "triton-cpu", timeout=300)
        stopped = time.monotonic() - started
        code = run(["podman", "inspect", "--format", "{{.State.ExitCode}}", name], capture=True).stdout.decode().strip()
        logs = run(["podman", "logs", "--tail", "30", name], capture=True, check=False)
        tail = (logs.stdout + logs.stderr).decode(errors="replace")
        self.compose("--profile", "cpu", "down", "--volumes", "--remove-orphans", timeout=300)
        if code != "0":
            raise RuntimeError(f"triton-cpu exited with {code} after stop: {tail[-1500:]}")
        bad = unreadable(self.r.tree / "model_repository")
        if bad:
            raise RuntimeError(f"left unreadable under model_repository: {bad[:10]}")
        return f"stopped in {stopped:.0f} s with exit code 0; model_repository readable by every user"

    # ------------------------------------------------------------------ gpu profile
    def gpu_build(self) -> str:
        gpu_tree = self.r.workdir / "gpu-tree"
        shutil.copytree(self.r.tree, gpu_tree, symlinks=True)
        self.r.gpu_tree = gpu_tree
        env = dict(self.env, COMPOSE_PROFILES="gpu", WHISPER_GPU_MODEL=REHEARSAL_WHISPER_MODEL)
        started = time.monotonic()
        self.r.compose(gpu_tree, self.project + "gpu", "--profile", "gpu", "run", "--rm", "--no-deps",
                       "repository-builder", env=env, timeout=3600,
                       files=("docker-compose.yml", NO_GPU_OVERRIDE))
        built = BuiltManifest.read(gpu_tree / "model_repository")
        if built.target != "gpu":
            raise RuntimeError(f"the builder service built {built.target}")
        return (f"gpu target ({len(built.models)} models, the packaged real Whisper base, not large-v3: "
                f"~19.3 GiB to export) in {time.monotonic() - started:.0f} s")

    def gpu_serving(self) -> str:
        env = dict(self.env, COMPOSE_PROFILES="gpu")
        result = self.r.compose(
            self.r.gpu_tree, self.project + "gpu", "--profile", "gpu", "run", "--rm", "--no-deps",
            # check.py is dev tooling, not in the image: mounted from the tree, read-only.
            "--volume", f"{self.r.gpu_tree / 'tools'}:/opt/rehearse/tools:ro", "--env", "PYTHONPATH=/opt/rehearse",
            "--entrypoint", "python3", "triton", "-m", "tools.rehearse.check",
            "--model-repository", "/models", "--backend-dir", "/opt/tritonserver/backends",
            "--tritonserver", "/opt/tritonserver/bin/tritonserver",
            env=env, timeout=1200, capture=True, check=False,
            files=("docker-compose.yml", NO_GPU_OVERRIDE))
        out = (result.stdout + result.stderr).decode(errors="replace")
        with open(self.r.logfile, "a") as log:
            log.write(out)
        summary = [line for line in out.splitlines() if line.startswith("check:")]
        # Compose's `run` against podman 4.3 exits 0 even when the container could not start ("unable
        # to upgrade to tcp, received 409") or exited non-zero: the check's own lines decide.
        if result.returncode != 0 or len(summary) != CHECKS or any(" FAIL" in line for line in summary):
            raise RuntimeError(f"exit {result.returncode}, {len(summary)} of {CHECKS} checks: "
                               + ("; ".join(summary) or out[-2000:]))
        return "; ".join(line[len("check: "):] for line in summary)

    def cleanup(self) -> str:
        if getattr(self, "receiver", None) is not None:
            self.receiver.close()
        if self.r.keep:
            return f"kept {self.r.workdir}"
        for project in (self.project, self.project + "gpu"):
            for tree in (self.r.tree, self.r.gpu_tree):
                if tree is not None:
                    self.r.compose(tree, project, "--profile", "cpu", "--profile", "gpu", "down", "--volumes",
                                   "--remove-orphans", env=self.env or self.r.start_service(), check=False,
                                   timeout=300)
        for tree in (self.r.tree, self.r.gpu_tree):
            if tree is not None:
                shutil.rmtree(tree, ignore_errors=True)
        return f"removed the trees under {self.r.workdir}"


def steps(rehearsal) -> list:
    s = Steps(rehearsal)
    return [("cpu: prepare tree", s.prepare), ("cpu: compose up", s.cpu_up),
            ("cpu: pipelines through the public ports", s.cpu_pipelines),
            ("cpu: a trace from inside the container", s.cpu_trace),
            ("cpu: prometheus", s.cpu_prometheus), ("cpu: compose stop and down", s.cpu_down),
            ("gpu: builder service", s.gpu_build), ("gpu: serving container checks", s.gpu_serving),
            (CLEANUP_STEP, s.cleanup)]


__all__ = ["steps", "unreadable", "TARGET_IMAGES", "TRITON_MODULES", "server_imports"]
