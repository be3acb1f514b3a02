"""Code that runs only inside Triton's Python-backend stub: the one part of ``triton_pipelines``
that imports ``triton_python_backend_utils``. The ``model.py`` adapters use it to turn our plain
results into responses, errors and custom metrics."""
