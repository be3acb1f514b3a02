# The two commands a new user needs: `make serve` and `make test`. Each does all set-up first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
BENCH_INSTALLED := $(VENV)/.bench-installed
# The speech quality tests and benchmark speak their clips with Debian's espeak-ng.
ESPEAK_INSTALLED := $(VENV)/.espeak-installed
TARGET ?= embedded
BUILD_FLAGS ?=

.PHONY: install repository serve test bench clean

install: $(INSTALLED)

$(INSTALLED): requirements.txt requirements-nodeps.txt pyproject.toml
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
serve: repository
	$(PY) -m triton_pipelines.launcher --model-repository model_repository

test: repository $(ESPEAK_INSTALLED)
	$(PY) -m pytest -ra

$(ESPEAK_INSTALLED): $(INSTALLED)
	@if ! command -v espeak-ng >/dev/null; then \
	  (apt-get install -y -q espeak-ng || (apt-get update -q && apt-get install -y -q espeak-ng)); fi
	touch $@

# Only the speech section of docs/benchmarks.md (Whisper base vs faster-whisper), on model_repository/.
.PHONY: bench-speech
bench-speech: repository $(BENCH_INSTALLED) $(ESPEAK_INSTALLED)
	$(PY) -m benchmarks bench_speech

# perf_analyzer needs Debian's libb64 and libcudart.so.12 (from PyPI) even without a GPU.
$(BENCH_INSTALLED): $(INSTALLED) requirements-bench.txt
	@if ! ldconfig -p | grep -q libb64.so.0d; then \
	  (apt-get install -y -q libb64-0d || (apt-get update -q && apt-get install -y -q libb64-0d)); fi
	$(PY) -m pip install --quiet -r requirements-bench.txt
	touch $@

# Its own repository (with bert-base): building model_repository/ with and without
# --with-bert-base in turn would delete and re-export bert-base every time.
BENCH_REPOSITORY := .bench/model_repository
bench: $(BENCH_INSTALLED) $(ESPEAK_INSTALLED)
	$(PY) -m repo_builder --target embedded --output $(BENCH_REPOSITORY) --with-bert-base $(BUILD_FLAGS)
	BENCH_MODEL_REPOSITORY=$(BENCH_REPOSITORY) $(PY) -m benchmarks

clean:
	rm -rf $(VENV) .cache .bench model_repository/*/
