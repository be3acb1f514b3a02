"""The OpenAI-compatible ``/v1`` frontend: its protocol (validation, errors, response shapes) and the
aiohttp server that nginx routes ``/v1/`` to."""
