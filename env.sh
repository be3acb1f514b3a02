export PYTHONPATH=/work/wt-hub/src:/work/wt-hub/build:/work/wt-hub
export PATH=/work/main/.venv/bin:$PATH
export TRITON_PIPELINES_ROOT=/work/wt-hub
cd /work/wt-hub
