"""Pipeline logic for the Triton model repository, and the embedded-server launcher.

Everything here is plain Python with no Triton import, so it is unit-tested without a server;
the ``model.py`` files under ``python_models/`` are thin adapters over it.
"""
