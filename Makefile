# The two commands a new user needs: `make serve` and `make test`. Each does all set-up first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
BENCH_INSTALLED := $(VENV)/.bench-installed
TARGET ?= embedded
BUILD_FLAGS ?=

.PHONY: install repository serve test test-unit bench bench-quick soak lifecycle clean prometheus-tools dashboard k8s-rules rehearse

install: $(INSTALLED)

# Debian packages: nginx (the public front of the server, see src/triton_pipelines/front/nginx_config.py),
# espeak-ng (the speech quality tests and benchmark speak their clips with it) and postgresql (the
# spend ledger's tests start their own PostgreSQL server: tests/support/postgres_server.py).
SYSTEM_PACKAGES := nginx-core espeak-ng postgresql

$(INSTALLED): requirements.txt requirements-serving.txt requirements-builder.txt requirements-embedded.txt requirements-nodeps.txt requirements-ops.txt pyproject.toml
	@missing=""; for package in $(SYSTEM_PACKAGES); do \
	  dpkg -s $$package >/dev/null 2>&1 || missing="$$missing $$package"; done; \
	if [ -n "$$missing" ]; then \
	  apt-get install -y -q --no-install-recommends $$missing || \
	  (apt-get update -q && apt-get install -y -q --no-install-recommends $$missing); fi
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch==2.13.0 first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0 -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

# Assemble model_repository/ (export ONNX, write configs). Fast when nothing changed.
repository: install
	$(PY) -m repo_builder --target $(TARGET) $(BUILD_FLAGS)

# Real Triton on 8000 (HTTP) / 8001 (gRPC) / 8002 (metrics), in the foreground like `docker compose up`.
# The memory planner checks first that every model at its max batch fits this machine (docs/operations.md).
serve: repository
	$(PY) -m repo_builder plan --check
	$(PY) -m triton_pipelines serve --model-repository model_repository

test: repository prometheus-tools
	$(PY) -m pytest -ra

# The fast subset: every test outside tests/server/ (a server test elsewhere is a collection error,
# tests/conftest.py), less the few marked `slow` (pip resolution, checkpoint exports, planner builds).
# Measured on 2 cores, 2026-12-02 (load average 1.2): 620 tests in 72 s. `make test` runs everything.
test-unit: repository prometheus-tools
	$(PY) -m pytest -ra -q -m "not server and not slow"

# Build and run the shipped images with podman (docker/Dockerfile and docker-compose.yml unedited):
# podman, runc and debootstrap from Debian, local stand-ins for the base images, the three targets,
# the cpu profile end to end through Docker Compose v2 on free ports, the gpu profile as far as a
# machine without a GPU allows. One line per step; non-zero on any failure. Root, as on our machines.
# Logic: tools/rehearse/__main__.py (docs/deployment.md).
rehearse: install
	$(PY) -m tools.rehearse

# promtool and prometheus for the monitoring tests (tests/test_prometheus*.py): Debian's package
# (2.42 on bookworm). Its post-install may start the system service: stop it, the tests start
# their own on free loopback ports.
prometheus-tools:
	@if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then \
	  (apt-get install -y -q --no-install-recommends prometheus || \
	   (apt-get update -q && apt-get install -y -q --no-install-recommends prometheus)) && \
	  if [ -x /etc/init.d/prometheus ]; then /etc/init.d/prometheus stop >/dev/null 2>&1 || true; fi; fi

# Regenerate the generated monitoring files after editing their sources (tests fail when stale).
dashboard: install
	$(PY) deploy/grafana/build_dashboard.py
k8s-rules: install
	$(PY) deploy/k8s/render_prometheusrule.py

# Only the speech section of docs/benchmarks.md (Whisper base vs faster-whisper), on model_repository/.
.PHONY: bench-speech bench-openai
bench-speech: repository $(BENCH_INSTALLED)
	$(PY) -m benchmarks bench_speech

# The OpenAI-compatible frontend: /v1/embeddings against native, time to the first streamed partial.
bench-openai: repository $(BENCH_INSTALLED)
	$(PY) -m benchmarks bench_openai

# perf_analyzer needs Debian's libb64 and libcudart.so.12 (from PyPI) even without a GPU.
$(BENCH_INSTALLED): $(INSTALLED) requirements-bench.txt
	@if ! ldconfig -p | grep -q libb64.so.0d; then \
	  (apt-get install -y -q libb64-0d || (apt-get update -q && apt-get install -y -q libb64-0d)); fi
	$(PY) -m pip install --quiet -r requirements-bench.txt
	touch $@

# Its own repository (with bert-base, and the tutorial's ResNet-50 as the image classifier: random
# weights, asked for by name, timing only; the report says so): building model_repository/ with and
# without them in turn would delete and re-export them every time.
BENCH_REPOSITORY := .bench/model_repository
# Infinity, the embedding-server peer, in a venv of its own (its pins clash with the served stack's).
# A failed install does not stop the benchmark: the report says why Infinity did not run (.error).
INFINITY_VENV := .bench/venvs/infinity
$(INFINITY_VENV)/.installed: requirements-bench-infinity.txt
	@rm -f $(INFINITY_VENV)/.error; mkdir -p $(dir $(INFINITY_VENV))
	@( $(PYTHON) -m venv $(INFINITY_VENV) && \
	   $(INFINITY_VENV)/bin/python -m pip install --quiet torch==2.13.0 && \
	   $(INFINITY_VENV)/bin/python -m pip install --quiet -r requirements-bench-infinity.txt ) \
	  > $(INFINITY_VENV).log 2>&1 || { mkdir -p $(INFINITY_VENV); tail -20 $(INFINITY_VENV).log > $(INFINITY_VENV)/.error; \
	  echo "Infinity could not be installed (see $(INFINITY_VENV).log); the benchmark goes on without it"; }
	touch $@

# BENCH_MODE=full (default, 48 min measured on 2 cores) or quick (the peers and the sweep, 9 min measured);
# BENCH_P95_MS=... BENCH_WRITE_BACK=1 steer the config search (benchmarks/bench_sweep.py).
BENCH_MODE ?= full
BENCH_P95_MS ?=
BENCH_WRITE_BACK ?=
bench: $(BENCH_INSTALLED) $(INFINITY_VENV)/.installed
	$(PY) -m repo_builder --target embedded --output $(BENCH_REPOSITORY) --with-bert-base \
	  --image-model random:resnet50 $(BUILD_FLAGS)
	BENCH_MODEL_REPOSITORY=$(BENCH_REPOSITORY) BENCH_MODE=$(BENCH_MODE) BENCH_P95_MS=$(BENCH_P95_MS) \
	  BENCH_WRITE_BACK=$(BENCH_WRITE_BACK) $(PY) -m benchmarks

bench-quick:
	$(MAKE) bench BENCH_MODE=quick

# Mixed traffic, hostile requests and injected faults for SOAK_SECONDS (default 600) → docs/reliability.md.
SOAK_SECONDS ?= 600
soak: repository
	SOAK_SECONDS=$(SOAK_SECONDS) $(PY) -m benchmarks.soak

# Load time and first-request latency, without and with warm-up, per model and pipeline → docs/lifecycle.md.
lifecycle: repository
	$(PY) -m benchmarks.lifecycle

clean:
	rm -rf $(VENV) .cache .bench model_repository/*/
