"""The services a user would pick instead of Triton, run by ``make bench`` on the same machine:
FastAPI + uvicorn + ONNX Runtime per pipeline (``text``, ``vision``, ``speech``) and Infinity
(``infinity``) for text embeddings. Each listens on 127.0.0.1 only."""
