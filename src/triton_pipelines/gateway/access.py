"""Who may call which model: a request's API key authenticated (401) and its models checked (403)."""

from __future__ import annotations

from triton_pipelines.gateway.keys import ApiKey, KeyRing, bearer_secret
from triton_pipelines.gateway.refusal import GatewayRefusal
from triton_pipelines.gateway.recorder import SpendRecorder


class Access:
    """The keys file's say on a request (no keys file: every request is anonymous and allowed)."""

    def __init__(self, keys: KeyRing | None, recorder: SpendRecorder):
        self.keys = keys
        self.recorder = recorder

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """``Authorization`` header value → the key; None when no keys file is configured.
        GatewayRefusal 401 for a missing or unknown key when one is."""
        if self.keys is None:
            return None
        secret = bearer_secret(authorization)
        key = self.keys.lookup(secret) if secret else None
        if key is None:
            raise self.unauthenticated("missing" if secret is None else "unknown")
        return key

    def key_by_id(self, key_id: str | None) -> ApiKey | None:
        """A key id forwarded by the request screen → the key (None without a keys file)."""
        if self.keys is None:
            return None
        key = self.keys.by_id(key_id) if key_id else None
        if key is None:
            raise self.unauthenticated("missing" if not key_id else "unknown")
        return key

    def unauthenticated(self, which: str) -> GatewayRefusal:
        self.recorder.refusal("unknown", "unauthenticated")
        text = ("gateway requests need an API key: send `Authorization: Bearer <key>`" if which == "missing"
                else "the API key is not known to this server")
        return GatewayRefusal(401, "unauthenticated", text)

    def check(self, api_key: ApiKey | None, model: str) -> None:
        """A request for ``model`` with ``api_key``: 401 without a key where one is needed, 403 for a
        model outside the key's ``models``."""
        if self.keys is not None and api_key is None:
            raise self.unauthenticated("missing")
        if api_key is not None and not api_key.allows_model(model):
            self.recorder.refusal(api_key.name, "model_not_allowed")
            raise GatewayRefusal(403, "model_not_allowed", f"key {api_key.name} may not use model {model} "
                                 f"(its models: {', '.join(api_key.models or ())})")
