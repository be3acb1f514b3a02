#!/usr/bin/env bash
# The benchmark suite on a local NVIDIA GPU, without the container: the embedded server with the
# compute models on ONNX Runtime's TensorRT/CUDA providers (requirements-gpu.txt, builder flag
# --embedded-execution-providers). Writes docs/benchmarks-gpu.md, naming the card.
#
#   benchmarks/gpu.sh            # needs an NVIDIA driver (nvidia-smi) and Python 3.11
#
# Its own venv (.venv-gpu) and repository (.bench/model_repository-gpu): onnxruntime-gpu replaces the
# CPU onnxruntime, so it cannot share .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv-gpu
REPOSITORY=.bench/model_repository-gpu
PROVIDERS="${PROVIDERS:-tensorrt,cuda,cpu}"

command -v nvidia-smi >/dev/null || { echo "no NVIDIA driver (nvidia-smi) on this machine" >&2; exit 1; }
# perf_analyzer (tritonclient wheel) needs Debian's libb64 and nginx fronts the server, as in make.
for package in libb64-0d nginx-core; do
  dpkg -s "$package" >/dev/null 2>&1 || apt-get install -y -q --no-install-recommends "$package" \
    || (apt-get update -q && apt-get install -y -q --no-install-recommends "$package")
done
CARD="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
echo "[gpu] $CARD"

if [[ ! -f "$VENV/.installed" ]]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  # The builder's packages (torch pinned: CPU build, export needs no GPU), then the GPU runtime.
  "$VENV/bin/pip" install --quiet torch==2.13.0 -r requirements-builder.txt
  "$VENV/bin/pip" uninstall --quiet -y onnxruntime
  "$VENV/bin/pip" install --quiet -r requirements-gpu.txt "tritonclient[all]==2.51.0" -r requirements-bench.txt
  "$VENV/bin/pip" install --quiet --no-deps -r requirements-nodeps.txt
  "$VENV/bin/pip" install --quiet --no-deps -e .
  touch "$VENV/.installed"
fi
# A real session on CUDA, not get_available_providers() (which lists CUDA even when it cannot load:
# onnxruntime-gpu 1.31 needs driver >= 580): fails loudly instead of benchmarking the CPU.
"$VENV/bin/python" -m benchmarks.gpu_check

"$VENV/bin/python" -m repo_builder --target embedded --output "$REPOSITORY" --with-bert-base \
  --embedded-execution-providers "$PROVIDERS"
BENCH_MODEL_REPOSITORY="$REPOSITORY" BENCH_REPORT=docs/benchmarks-gpu.md \
  BENCH_MACHINE_NOTE="GPU: $CARD; compute models on ONNX Runtime providers $PROVIDERS (embedded server)" \
  "$VENV/bin/python" -m benchmarks "$@"
