"""The memory planner (``python -m repo_builder plan``): will the built repository fit, and how to
place it if not; estimated from the repository's files, not from a running server.

- ``sizes``: units, the GPU budget and sizes, the measured and assumed per-process constants;
- ``graph``: one ONNX graph's weights and live activation peak;
- ``estimates``: the built repository's model instances and each one's estimate;
- ``shm``: the Python stubs' shared-memory regions (host ``/dev/shm``);
- ``placement``: model instances on GPUs (first fit, fewer instances, the smallest fleet);
- ``report``: the GPU and host reports;
- ``cli``: ``python -m repo_builder plan [--check | --shm | --json ...]``.
"""
