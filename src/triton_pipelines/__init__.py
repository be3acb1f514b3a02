"""Pipeline logic for the Triton model repository, and the embedded-server launcher.

Everything here but the ``stub`` subpackage is plain Python with no Triton import, so it is
unit-tested without a server; the ``model.py`` files under ``python_models/`` are thin adapters
over it. ``stub`` is the Triton-facing side: it runs only inside Triton's Python-backend stub and
is the one place that imports ``triton_python_backend_utils``.
"""
