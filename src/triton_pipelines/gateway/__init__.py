"""The external LLM gateway: the OpenAI-compatible upstream client (``upstream``), API keys
(``keys``), the spend ledger (``ledger``) and the service around them (``service``) that the
router's gateway path and the ``/v1`` frontend both call."""
