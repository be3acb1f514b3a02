#!/usr/bin/env bash
# One-shot TensorRT engine builder (docker compose service `trt-engine-builder`, NGC TensorRT 24.10,
# the TensorRT release of tritonserver 24.10). For every compute model the repository builder emitted
# as `tensorrt_plan` (`--<model>-gpu-backend tensorrt_plan`), it reads <model>/1/trtexec.args (FP16,
# min/opt/max batch shapes) and turns <model>/1/model.onnx into <model>/1/model.plan.
#
# Rebuilds only when the plan is missing, older than the ONNX file, or built with other flags
# (model.plan.args records them). Engines are specific to the GPU model and the TensorRT version.
# Latency-class variants (<model>_<suffix>) link to their base model's files: they get a link to its
# plan instead of a second build.
set -euo pipefail
REPOSITORY="${1:-/workspace/model_repository}"

TRTEXEC="$(command -v trtexec || true)"
for candidate in /opt/tensorrt/bin/trtexec /usr/src/tensorrt/bin/trtexec; do
  [[ -z "$TRTEXEC" && -x "$candidate" ]] && TRTEXEC="$candidate"
done
[[ -n "$TRTEXEC" ]] || { echo "trtexec not found: run this in nvcr.io/nvidia/tensorrt" >&2; exit 1; }

shopt -s nullglob
built=0
for args_file in "$REPOSITORY"/*/1/trtexec.args; do
  version_dir="$(dirname "$args_file")"
  model="$(basename "$(dirname "$version_dir")")"
  if [[ -L "$args_file" ]]; then
    # A variant: model.onnx -> ../../<base>/1/model.onnx, so link model.plan the same way.
    target="$(dirname "$(readlink "$version_dir/model.onnx")")/model.plan"
    ln -sfn "$target" "$version_dir/model.plan"
    echo "[trt] $model: model.plan -> $target"
    continue
  fi
  mapfile -t flags < "$args_file"
  plan="$version_dir/model.plan"
  if [[ -f "$plan" && "$plan" -nt "$version_dir/model.onnx" ]] && cmp -s "$args_file" "$plan.args"; then
    echo "[trt] $model: model.plan up to date"
    continue
  fi
  echo "[trt] $model: trtexec ${flags[*]}"
  "$TRTEXEC" --onnx="$version_dir/model.onnx" --saveEngine="$plan.tmp" "${flags[@]}" --skipInference
  mv "$plan.tmp" "$plan"
  cp "$args_file" "$plan.args"
  built=$((built + 1))
done
echo "[trt] built $built engine(s) in $REPOSITORY"
