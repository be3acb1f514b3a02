"""The OpenAI-compatible surface's protocol: request validation, errors, response shapes, SSE framing.

Plain functions and data, no server and no Triton: the rest of ``openai_api/`` (the aiohttp process
the launcher runs behind nginx's ``/v1/``) is a thin layer over this module, and
``tests/unit/openai_api/test_protocol.py`` tests it without a server.

- Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` and status
  (``OpenAIError``): 400 bad input naming the field (``param``), 401 missing or unknown key, 404
  unknown model or path, 405, 413 too large, 429 refused by a limit, 503 not available now.
- ``ModelCatalog``: what ``GET /v1/models`` lists and how a request's ``model`` resolves: the
  self-hosted pipelines under their ensemble names (``owned_by: "self-hosted"``; alias ``whisper-1``
  for ``speech_recognition``) and the gateway models of the route table (``owned_by: "gateway"``).
- ``EmbeddingsRequest``, ``TranscriptionRequest``, ``ChatRequest``: a body → validated fields.
- Chat over ``GatewayService`` (budgets, rate limits, fallbacks, the spend ledger): a request →
  its arguments (``chat_arguments``), its answer → ``chat.completion`` (``chat_completion``) with
  the headers saying which model answered and why (``gateway_headers``), a streamed chunk → what
  the client gets (``chat_chunk``), a refusal or failure → the OpenAI error (``gateway_failure``).
- Request fields by JSON type as OpenAI's API checks them (``_typed``: integers, numbers, booleans,
  strings, objects; wrong type 400 ``invalid_type`` naming the field), multipart's text fields.
- Transcripts in every ``response_format``: ``transcripts.py``.
- ``sse``: one server-sent event.
"""

from __future__ import annotations

import base64
import json
import math
from decimal import Decimal
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np
import orjson

from triton_pipelines.errors import openai_error_body
from triton_pipelines.limits import MAX_TEXT_BYTES
from triton_pipelines.openai_api.json_budget import MAX_JSON_STRUCTURE, json_structure

# ----------------------------------------------------------------------------------- limits
# Strings in one /v1/embeddings request (OpenAI's own limit). They go to Triton as requests of at most
# the pipeline's max batch (64): a list of 64 strings is ONE request to text_embedding.
MAX_EMBEDDING_INPUTS = 2048
# One string: text_tokenizer's max_text_bytes (python_models/text_tokenizer/config.pbtxt).
# Multipart (audio): parts, the file (limits.MAX_AUDIO_BYTES, audio_features' max_audio_bytes),
# every other field, and the file name.
MAX_MULTIPART_PARTS = 16
MAX_FIELD_BYTES = 16 * 1024
MAX_FILENAME_CHARS = 1024
# JSON bodies: /v1/chat/completions (its file, image and audio parts are base64) and
# /v1/embeddings (2048 inputs of 4 KiB; a text is cut at 256 tokens anyway); the front's body limit
# is larger (audio), and the app's (aiohttp's client_max_size) is the larger of these.
MAX_JSON_BODY_BYTES = 16 * 1024 * 1024
MAX_EMBEDDINGS_BODY_BYTES = 8 * 1024 * 1024
# Bytes before a multipart body's first boundary (its preamble: no client sends one). aiohttp reads
# it a line at a time: 60 MiB of line breaks held the event loop 100 s.
MAX_MULTIPART_PREAMBLE_BYTES = 1024
# Chat: messages per request and a message's text (the gateway's own limits apply after).
MAX_CHAT_MESSAGES = 256

SELF_HOSTED_OWNER = "self-hosted"
GATEWAY_OWNER = "gateway"
# The self-hosted pipelines the API serves, by what they do.
EMBEDDING_MODELS = ("text_embedding",)
SPEECH_MODELS = ("speech_recognition",)
SELF_HOSTED_MODELS = ("text_embedding", "text_classification", "image_classification", "speech_recognition")
ALIASES = {"whisper-1": "speech_recognition"}
RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
ENCODING_FORMATS = ("float", "base64")


# ----------------------------------------------------------------------------------- errors
@dataclass
class OpenAIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        super().__init__(self.message)

    def body(self) -> dict:
        return openai_error_body(self.message, self.type, self.code, self.param)


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def unauthorized(message: str) -> OpenAIError:
    return OpenAIError(401, message, "invalid_request_error", None, "invalid_api_key")


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model '{model}' does not exist or you do not have access to it.",
                       "invalid_request_error", "model", "model_not_found")


def too_large(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(413, message, "invalid_request_error", param, "request_too_large")


def rate_limited(message: str, retry_after_s: int = 1) -> OpenAIError:
    return OpenAIError(429, message, "rate_limit_error", None, "rate_limit_exceeded",
                       {"Retry-After": str(retry_after_s)})


def unavailable(message: str, retry_after_s: int | None = 1) -> OpenAIError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s else {}
    return OpenAIError(503, message, "server_error", None, "service_unavailable", headers)


def internal(message: str) -> OpenAIError:
    return OpenAIError(500, message, "server_error", None, "internal_error")


def parse_json_body(raw: bytes, limit: int = MAX_JSON_BODY_BYTES) -> dict:
    """A JSON object body, or OpenAIError (413 over ``limit``, 400 otherwise).

    Unlike the screen's ``parse_json_header`` it accepts a repeated key (the last wins, as Python's
    and OpenAI's parsers do) and counts no objects: the screen refuses both because Triton parses the
    body again with another parser, and a duplicate-key hook costs Python time per object; here this
    parse is the only one, in C, and chat content may hold any number of braces."""
    if len(raw) > limit:
        raise too_large(f"the request body is {len(raw)} bytes; the limit for JSON bodies is {limit} bytes")
    if not raw.strip():
        raise invalid("the request body is empty: send a JSON object")
    if json_structure(raw) > MAX_JSON_STRUCTURE:
        raise invalid(f"the request body holds more than {MAX_JSON_STRUCTURE} JSON values (strings, numbers, "
                      f"arrays, objects): the limit of a /v1 request", code="request_too_complex")
    try:
        document = json.loads(raw)
    except RecursionError:
        raise invalid("the request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise invalid(f"the request body is not valid JSON: {str(error)[:200]}") from None
    if not isinstance(document, dict):
        raise invalid(f"the request body must be a JSON object, not {type(document).__name__}")
    return document


# ----------------------------------------------------------------------------------- fields
# JSON types as OpenAI's API checks them: an integer is a JSON integer (not true, not "7", not 7.0), a
# number a JSON number, a boolean true or false; a wrong type is 400 ``invalid_type`` naming the field,
# a value out of range 400 naming it too (an integer of any size is compared exactly, never made a
# float). Multipart fields are text: ``_text_boolean`` and ``_text_number`` read them (audio).
JSON_TYPES = {"integer": "an integer", "number": "a number", "boolean": "a boolean", "string": "a string",
              "object": "an object"}
_IS_TYPE = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            "boolean": lambda v: isinstance(v, bool), "string": lambda v: isinstance(v, str),
            "object": lambda v: isinstance(v, dict)}


def json_type(value) -> str:
    """A parsed JSON value's type as OpenAI's errors name it."""
    if isinstance(value, bool):
        return "a boolean"
    return {int: "an integer", float: "a decimal", str: "a string", list: "an array", dict: "an object"}.get(
        type(value), "null")


def _typed(body: Mapping, name: str, kind: str, prefix: str = ""):
    value = body.get(name)
    if value is not None and not _IS_TYPE[kind](value):
        raise invalid(f"Invalid type for '{prefix}{name}': expected {JSON_TYPES[kind]}, but got {json_type(value)} "
                      f"instead.", prefix + name, "invalid_type")
    return value


def _string(body: Mapping, name: str, required: bool = False, choices: Sequence[str] | None = None,
            default: str | None = None, max_chars: int = 256) -> str | None:
    value = _typed(body, name, "string")
    if value is None:
        if required:
            raise invalid(f"'{name}' is required", name)
        return default
    if len(value) > max_chars:
        raise invalid(f"'{name}' is longer than {max_chars} characters", name)
    if choices is not None and value not in choices:
        raise invalid(f"'{name}' must be one of {', '.join(choices)}; got {value[:64]!r}", name)
    return value


def _boolean(body: Mapping, name: str, default: bool = False, prefix: str = "") -> bool:
    value = _typed(body, name, "boolean", prefix)
    return default if value is None else value


def _number(body: Mapping, name: str, low: float, high: float, default: float | None = None,
            integer: bool = False) -> float | None:
    value = _typed(body, name, "integer" if integer else "number")
    return default if value is None else _in_range(name, value, low, high, integer)


def _in_range(name: str, value, low: float, high: float, integer: bool = False):
    kind = "integer" if integer else "decimal"
    digits = len(str(abs(value))) if isinstance(value, int) else 0
    shown = f"an integer of {digits} digits" if digits > 40 else str(value)
    if isinstance(value, float) and not math.isfinite(value):  # NaN, Infinity: Python's parser reads them
        raise invalid(f"Invalid '{name}': expected a finite number, but got {shown} instead.", name, "invalid_value")
    for out, side, bound, sign in ((value < low, "below minimum", low, ">="), (value > high, "above maximum", high, "<=")):
        if out:
            raise invalid(f"Invalid '{name}': {kind} {side} value. Expected a value {sign} {bound}, but got {shown} "
                          f"instead.", name, f"{kind}_{side.replace('imum', '').replace(' ', '_')}_value")
    return value


def _text_boolean(fields: Mapping[str, str], name: str) -> bool:
    """A multipart field ``true`` or ``false`` (any case)."""
    value = fields.get(name)
    if value is None or value.lower() in ("true", "false"):
        return value is not None and value.lower() == "true"
    raise invalid(f"Invalid '{name}': expected true or false, but got {value[:32]!r} instead.", name, "invalid_type")


def _text_number(fields: Mapping[str, str], name: str, low: float, high: float, default: float) -> float:
    """A multipart field holding a decimal number (a finite one, in range)."""
    text = fields.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise invalid(f"Invalid '{name}': expected a number, but got {text[:32]!r} instead.", name,
                      "invalid_type") from None
    return _in_range(name, value, low, high)


# ----------------------------------------------------------------------------------- models
@dataclass(frozen=True)
class ModelCatalog:
    """The models of ``GET /v1/models``: ``self_hosted`` pipelines (those the server built and
    serves) and ``gateway`` models (the route table's priced models)."""

    self_hosted: tuple[str, ...]
    gateway: tuple[str, ...] = ()
    aliases: Mapping[str, str] = field(default_factory=lambda: dict(ALIASES))
    created: int = 0
    # self-hosted model → the provenance of the compute models behind it (``BuiltManifest.provenance_of``)
    provenance: Mapping[str, list] = field(default_factory=dict)

    @classmethod
    def build(cls, public_models: Iterable[str] | None, gateway_models: Iterable[str], created: int = 0,
              provenance: Mapping[str, list] | None = None) -> "ModelCatalog":
        public = set(public_models) if public_models is not None else set(SELF_HOSTED_MODELS)
        hosted = tuple(m for m in SELF_HOSTED_MODELS if m in public)
        aliases = {alias: target for alias, target in ALIASES.items() if target in hosted}
        return cls(hosted, tuple(sorted(set(gateway_models))), aliases, created, dict(provenance or {}))

    def entries(self) -> list[dict]:
        """OpenAI's model objects (``id``, ``object``, ``created``, ``owned_by``); a self-hosted one
        adds ``provenance``: its compute models' weights (source, revision, sha256, licence ...)."""
        rows = [(name, SELF_HOSTED_OWNER) for name in self.self_hosted]
        rows += [(alias, SELF_HOSTED_OWNER) for alias in sorted(self.aliases)]
        rows += [(name, GATEWAY_OWNER) for name in self.gateway]
        entries = [{"id": name, "object": "model", "created": self.created, "owned_by": owner} for name, owner in rows]
        for entry in entries:
            served = self.provenance.get(self.aliases.get(entry["id"], entry["id"]))
            if served and entry["owned_by"] == SELF_HOSTED_OWNER:
                entry["provenance"] = served
        return entries

    def listing(self) -> dict:
        return {"object": "list", "data": self.entries()}

    def entry(self, model: str) -> dict:
        for row in self.entries():
            if row["id"] == model:
                return row
        raise model_not_found(model)

    def resolve(self, model: str, serves: Sequence[str], what: str) -> str:
        """A self-hosted ``model`` (or alias) among ``serves`` → its ensemble name; 404 for an unknown
        model, 400 for a known one that does not do ``what``."""
        name = self.aliases.get(model, model)
        if name in self.self_hosted and name in serves:
            return name
        if name in self.self_hosted or name in self.gateway:
            raise invalid(f"model '{model}' does not serve {what}; models that do: "
                          f"{', '.join(m for m in serves if m in self.self_hosted) or 'none on this server'}",
                          "model", "model_not_supported")
        raise model_not_found(model)

    def resolve_gateway(self, model: str) -> str:
        if model in self.gateway:
            return model
        if self.aliases.get(model, model) in self.self_hosted:
            raise invalid(f"model '{model}' is self-hosted and does not serve chat completions; chat models: "
                          f"{', '.join(self.gateway) or 'none (no gateway models in the route table)'}",
                          "model", "model_not_supported")
        raise model_not_found(model)


# ----------------------------------------------------------------------------------- embeddings
@dataclass(frozen=True)
class EmbeddingsRequest:
    model: str
    texts: list[str]
    encoding_format: str = "float"
    user: str | None = None


def parse_embeddings(body: Mapping, catalog: ModelCatalog, max_inputs: int = MAX_EMBEDDING_INPUTS) -> EmbeddingsRequest:
    model = _string(body, "model", required=True)
    name = catalog.resolve(model, EMBEDDING_MODELS, "embeddings")
    raw = body.get("input")
    if raw is None:
        raise invalid("'input' is required: a string or a list of strings", "input")
    if isinstance(raw, str):
        texts = [raw]
    elif isinstance(raw, list):
        if not raw:
            raise invalid("'input' must not be an empty list", "input")
        if len(raw) > max_inputs:
            raise invalid(f"'input' has {len(raw)} items; at most {max_inputs} per request", "input")
        if all(isinstance(item, int) and not isinstance(item, bool) for item in raw) or \
                any(isinstance(item, list) for item in raw):
            raise invalid("'input' as token-id arrays is not supported: send the text (a string or a list of "
                          "strings); the server tokenizes it with the model's own tokenizer", "input")
        for index, item in enumerate(raw):
            if not isinstance(item, str):
                raise invalid(f"'input[{index}]' must be a string, not {type(item).__name__}", "input")
        texts = list(raw)
    else:
        raise invalid(f"'input' must be a string or a list of strings, not {type(raw).__name__}", "input")
    for index, text in enumerate(texts):
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_TEXT_BYTES:
            raise invalid(f"'input[{index}]' is {size} bytes; the limit is {MAX_TEXT_BYTES} bytes per string "
                          f"(longer texts are truncated at 256 tokens anyway)", "input")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise invalid(f"'input[{index}]' holds a lone surrogate (not valid Unicode text)", "input") from None
    encoding = _string(body, "encoding_format", choices=ENCODING_FORMATS, default="float")
    dimensions = body.get("dimensions")
    if dimensions is not None:
        raise invalid("'dimensions' is not supported: the model's embeddings have a fixed width", "dimensions")
    user = _string(body, "user", max_chars=256)
    return EmbeddingsRequest(name, texts, encoding, user)


def embeddings_body(model: str, embeddings: np.ndarray, encoding_format: str, prompt_tokens: int) -> bytes:
    """``embeddings [n, dim]`` float32 → the response body, JSON bytes.

    ``float``: each value the shortest decimal that reads back as the same float32 (orjson's
    float32 writer; ``0.019155025``, not the float64 expansion ``0.01915502455085516``), so a
    client's float32 is bit for bit the model's output (tested) and the text is half as long;
    NaN or infinity (not in a normalized embedding) would be ``null``. ``base64``: the
    little-endian float32 bytes (what the ``openai`` client decodes)."""
    rows = np.ascontiguousarray(embeddings, dtype=np.float32)
    if encoding_format == "base64":
        rows = rows.astype("<f4", copy=False)
        data = [{"object": "embedding", "index": index, "embedding": base64.b64encode(row.tobytes()).decode("ascii")}
                for index, row in enumerate(rows)]
    else:
        data = [{"object": "embedding", "index": index, "embedding": row} for index, row in enumerate(rows)]
    return orjson.dumps({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": int(prompt_tokens), "total_tokens": int(prompt_tokens)}},
                        option=orjson.OPT_SERIALIZE_NUMPY)


def batches(count: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of at most ``size`` covering ``count`` items."""
    return [(start, min(start + size, count)) for start in range(0, count, size)]


# ----------------------------------------------------------------------------------- audio
@dataclass(frozen=True)
class TranscriptionRequest:
    model: str
    task: str  # transcribe | translate
    language: str | None
    response_format: str
    stream: bool
    temperature: float
    prompt: str | None
    filename: str
    # Not OpenAI's: Silero VAD as speaches and faster-whisper name it (true: only speech, packed into
    # windows; false: none; None, absent: the server's default, docs/speech.md).
    vad_filter: bool | None = None

    @property
    def timestamps(self) -> bool:
        """Whether the transcript needs Whisper's timestamp tokens (the formats with times)."""
        return self.response_format in ("verbose_json", "srt", "vtt")


TRANSCRIPTION_FIELDS = {"file", "model", "language", "prompt", "response_format", "temperature", "stream",
                        "timestamp_granularities[]", "timestamp_granularities", "include[]", "include",
                        "chunking_strategy", "vad_filter"}


def parse_transcription(fields: Mapping[str, str], filename: str | None, file_size: int | None, task: str,
                        catalog: ModelCatalog, language_codes: Sequence[str]) -> TranscriptionRequest:
    """The multipart fields (text) of /v1/audio/transcriptions or /translations, and the file's name
    and size (None: no ``file`` part)."""
    if file_size is None:
        raise invalid("'file' is required: the audio file as a multipart part named 'file'", "file")
    if file_size == 0:
        raise invalid("'file' is empty (0 bytes): send a WAV, FLAC or OGG file", "file")
    model = _string(fields, "model", required=True)
    name = catalog.resolve(model, SPEECH_MODELS, "audio transcriptions")
    language = _string(fields, "language", max_chars=16)
    if language is not None:
        language = language.strip().lower() or None
        if language is not None and language not in language_codes:
            raise invalid(f"'language' must be an ISO-639-1 code Whisper knows (en, de, fr, ...), not "
                          f"{language!r}", "language")
    response_format = _string(fields, "response_format", choices=RESPONSE_FORMATS, default="json")
    stream = _text_boolean(fields, "stream")
    if stream and response_format not in ("json", "text"):
        raise invalid(f"'stream' needs response_format json or text (not {response_format}): a streamed transcript "
                      f"is sent as transcript.text.delta / transcript.text.done events", "stream")
    temperature = _text_number(fields, "temperature", 0.0, 1.0, default=0.0)
    prompt = _string(fields, "prompt", max_chars=MAX_FIELD_BYTES)
    vad_filter = _text_boolean(fields, "vad_filter") if "vad_filter" in fields else None
    return TranscriptionRequest(name, task, language, response_format, stream, float(temperature), prompt,
                                filename or "", vad_filter)


# ----------------------------------------------------------------------------------- chat
@dataclass(frozen=True)
class ChatRequest:
    model: str
    body: dict  # the validated body, passed to the chat backend as it is
    stream: bool
    include_usage: bool


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# The scalar fields of a chat request, checked as OpenAI's API checks them (type, then range); of them
# only max_tokens, max_completion_tokens and temperature reach the gateway.
CHAT_NUMBERS = {"temperature": (0, 2), "top_p": (0, 1), "frequency_penalty": (-2, 2), "presence_penalty": (-2, 2)}
CHAT_INTEGERS = {"max_tokens": (1, 1_000_000), "max_completion_tokens": (1, 1_000_000), "n": (1, 128),
                 "top_logprobs": (0, 20), "seed": (-2**63, 2**63 - 1)}
CHAT_BOOLEANS = ("logprobs", "parallel_tool_calls", "store")


def parse_chat(body: Mapping, catalog: ModelCatalog) -> ChatRequest:
    model = _string(body, "model", required=True)
    name = catalog.resolve_gateway(model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list of messages", "messages")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise invalid(f"'messages' has {len(messages)} items; at most {MAX_CHAT_MESSAGES}", "messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"'messages[{index}]' must be an object", f"messages[{index}]")
        if message.get("role") not in CHAT_ROLES:
            raise invalid(f"'messages[{index}].role' must be one of {', '.join(CHAT_ROLES)}", f"messages[{index}].role")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise invalid(f"'messages[{index}].content' must be a string or a list of content parts",
                          f"messages[{index}].content")
    stream = _boolean(body, "stream")
    options = _typed(body, "stream_options", "object")
    if options and not stream:
        raise invalid("'stream_options' is only allowed with 'stream': true", "stream_options")
    include_usage = _boolean(options or {}, "include_usage", prefix="stream_options.")
    for field_name, (low, high) in CHAT_NUMBERS.items():
        _number(body, field_name, low, high)
    for field_name, (low, high) in CHAT_INTEGERS.items():
        _number(body, field_name, low, high, integer=True)
    for field_name in CHAT_BOOLEANS:
        _boolean(body, field_name)
    _string(body, "user")
    if body.get("n") not in (None, 1):
        raise invalid("'n' must be 1: one choice per request", "n")
    return ChatRequest(name, dict(body, model=name), stream, include_usage)


# The fields of a message passed on to the gateway (others, e.g. tool_calls, are not forwarded).
CHAT_MESSAGE_FIELDS = ("role", "content", "name", "tool_call_id")


def chat_arguments(request: ChatRequest, max_tokens_limit: int) -> dict:
    """A validated chat request → the keyword arguments of ``GatewayService.acomplete``/``astream``
    (``max_tokens``: ``max_completion_tokens`` or ``max_tokens``, at most the route file's limit;
    None: the route file's default)."""
    body = request.body
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    return {"model": request.model,
            "messages": [{k: v for k, v in message.items() if k in CHAT_MESSAGE_FIELDS} for message in body["messages"]],
            "max_tokens": None if max_tokens is None else min(int(max_tokens), max_tokens_limit),
            "temperature": body.get("temperature")}


def gateway_info(answer) -> dict:
    """Which model answered and why (a ``GatewayAnswer``): the ``x_gateway`` extension field."""
    return {"model": answer.model, "requested_model": answer.requested_model, "fallback_from": answer.fallback_from,
            "fallback_reason": answer.fallback_reason, "request_id": answer.request_id}


def usd_text(cost) -> str:
    """A cost as plain decimal text (``0.012``, never ``1.2E-2``)."""
    text = format(Decimal(str(cost)), "f")
    return (text.rstrip("0").rstrip(".") if "." in text else text) or "0"


def gateway_headers(info: Mapping, cost_usd=None) -> dict:
    """Response headers saying which model answered and why: ``x-gateway-model``,
    ``x-gateway-requested-model``, ``x-request-id`` (the ledger's request id), and after a fallback
    ``x-fallback-from`` and ``x-fallback-reason``; ``x-request-cost-usd`` when the cost is known."""
    headers = {"x-gateway-model": str(info.get("model") or ""),
               "x-gateway-requested-model": str(info.get("requested_model") or ""),
               "x-request-id": str(info.get("request_id") or "")}
    if info.get("fallback_from"):
        headers["x-fallback-from"] = str(info["fallback_from"])
        headers["x-fallback-reason"] = str(info.get("fallback_reason") or "unknown")
    if cost_usd is not None:
        headers["x-request-cost-usd"] = usd_text(cost_usd)
    return {name: value for name, value in headers.items() if value}


def chat_completion(answer, created: int) -> dict:
    """A ``GatewayAnswer`` → an OpenAI ``chat.completion``: ``id`` is the request id of the spend
    ledger's rows, ``model`` the model that answered, ``usage.cost_usd`` the exact cost, and the
    extension field ``x_gateway`` (``gateway_info``)."""
    return {
        "id": answer.request_id, "object": "chat.completion", "created": created, "model": answer.model,
        "choices": [{"index": 0, "finish_reason": answer.finish_reason or "stop",
                     "message": {"role": "assistant", "content": answer.text}}],
        "usage": {"prompt_tokens": answer.input_tokens, "completion_tokens": answer.output_tokens,
                  "total_tokens": answer.input_tokens + answer.output_tokens, "cost_usd": float(answer.cost_usd)},
        "x_gateway": gateway_info(answer),
    }


def chat_chunk(chunk: dict, include_usage: bool) -> dict | None:
    """A chunk of ``GatewayService.astream`` → what the client gets (None: nothing). The gateway's
    chunks lose ``x_gateway`` (the response headers say it) and, with ``include_usage``, carry
    ``usage: null`` as OpenAI's do; the service's last chunk (no choices; usage with ``cost_usd``,
    and ``x_gateway`` kept as an extension field) is sent only with ``include_usage``."""
    if chunk.get("choices"):
        chunk = {k: v for k, v in chunk.items() if k != "x_gateway"}
        if include_usage:
            chunk["usage"] = None
        return chunk
    return chunk if include_usage else None


# RouteError reasons (the gateway failed on every model of the request) → status, type, code.
GATEWAY_FAILURES = {
    "not_configured": (503, "server_error", "gateway_not_configured"),
    "circuit_open": (503, "server_error", "circuit_open"),
    "ledger_unavailable": (503, "server_error", "ledger_unavailable"),
    "timeout": (504, "server_error", "upstream_timeout"),
    "unreachable": (502, "server_error", "upstream_unreachable"),
    "upstream_status": (502, "server_error", "upstream_error"),
    "bad_response": (502, "server_error", "upstream_bad_response"),
    "rejected": (400, "invalid_request_error", "upstream_rejected"),
    "context_window": (400, "invalid_request_error", "context_length_exceeded"),
}


# A gateway refusal (GatewayRefusal's reason) → OpenAI's error type and code; rate limits name
# their limit (rpm_exceeded, tpm_exceeded).
REFUSALS = {"unauthenticated": ("invalid_request_error", "invalid_api_key"),
            "model_not_allowed": ("permission_error", "model_not_allowed"),
            "over_budget": ("insufficient_quota", "budget_exceeded"),
            "rate_limited": ("rate_limit_error", "{limit}_exceeded")}


def gateway_failure(error: Exception) -> OpenAIError:
    """A failure of ``GatewayService`` → the OpenAI error: a refusal (``GatewayRefusal``: 401, 403,
    429 with ``Retry-After``), bad input (``InputError``: 400), or the gateway failing on every
    model tried (``RouteError``: by reason, ``GATEWAY_FAILURES``)."""
    retry = getattr(error, "retry_after_s", None)
    headers = {"Retry-After": str(max(1, math.ceil(retry)))} if retry else {}
    if hasattr(error, "grpc_code"):  # GatewayRefusal
        kind, code = REFUSALS[error.reason]
        return OpenAIError(error.status, error.message, kind, None, code.format(limit=error.limit), headers)
    reason = getattr(error, "reason", None)
    if reason is None:  # InputError: the messages' (a part, a lone surrogate) or the model's
        return invalid(str(error), "messages" if str(error).startswith("messages") else "model")
    status, kind, code = GATEWAY_FAILURES.get(reason, (502, "server_error", "upstream_error"))
    return OpenAIError(status, str(error), kind, "messages" if reason == "context_window" else None, code,
                       headers if status in (429, 503) else {})


# ----------------------------------------------------------------------------------- SSE
def sse(data: Mapping | str, event: str | None = None) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n`` (``[DONE]`` as it is)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    prefix = f"event: {event}\n" if event else ""
    return f"{prefix}data: {payload}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
