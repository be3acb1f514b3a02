"""The Triton-facing side of ``triton_pipelines``: code that runs only inside Triton's Python-backend
stub, and the only part of the package that imports ``triton_python_backend_utils``. The
``model.py`` adapters under ``python_models/`` use it to read their arguments and requests
(``model_args``, ``responses``), to answer (``responses``: the request loop and the one mapping from
failures to error codes), to call other models (``bls``) and to publish custom metrics
(``metrics``)."""
