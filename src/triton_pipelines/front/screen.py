"""The request screen: what an inference request must look like before Triton 2.51 reads it.

nginx (``front/nginx_config.py``) bounds sizes, rates and APIs but cannot read a request's body. Some bodies
within every size limit still crash ``tritonserver`` 2.51 or get a wrong answer from it, so each
inference request (HTTP JSON header or gRPC ``ModelInferRequest``) is parsed here first, by a
parser that cannot be driven into deep recursion, and refused with a message naming the problem:

- the classification extension (``parameters.classification`` on a requested output): on a BYTES
  output, Triton divides by the element size 0 and dies (SIGFPE). Our pipelines return top-k
  themselves, so the extension is refused on every output, both protocols;
- JSON that Triton's recursive parser cannot take (deep nesting, balanced or not: CPython's C parser
  here stops at its recursion limit, linear time otherwise), duplicate keys
  (our parser and Triton's could then see different requests), anything but an object;
- shapes Triton truncates to 32 bits (``[4294967297, 1]`` is served as batch 1): every dimension
  must be at least 1, and the element count at most the body limit;
- parameters of the wrong type or range (``binary_data_size`` negative or fractional, ``binary_data``
  or ``sequence_start`` not a boolean, ``priority``, ``timeout`` or ``sequence_id`` negative, too large
  or fractional; ``PARAMETER_RULES``) and tensor ``data`` whose elements do not fit the datatype
  (numbers for BYTES, strings for FP32): Triton answers those with 500 "Unable to parse";
- an empty body (Triton serves it as an empty string);
- shared-memory parameters (the shared-memory APIs are not public, so no region can be named);
- inference on models that are not public (the pipelines and the router; ``public_models``).

Everything here is pure: the servers that apply it are in ``screen_server.py``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Iterable

from triton_pipelines.gateway.keys import KEY_ID_PARAMETER
from triton_pipelines.limits import CLIENT_CANCEL_PARAMETER, CLIENT_DEADLINE_PARAMETER

# How deep the screen's JSON parser (CPython's, in C) nests before it stops with RecursionError:
# the interpreter's recursion limit, 1,000 by default; far deeper than any KServe v2 request needs
# (a tensor of rank r nests r + 3 deep), far below the ~104,000 at which Triton 2.51's parser
# overflows its stack. Nothing deeper is ever forwarded.
MAX_JSON_DEPTH = 1000
# Objects in one request's JSON, counted as '{' bytes (strings included: an over-count). The
# screen's parser spends ~0.5 µs of Python per object checking for duplicate keys: 128 KiB of
# '{},' (43,000 objects) cost 20 ms of the screen's one thread. A KServe request needs a few per
# tensor; tensor data that holds more braces belongs in binary form.
MAX_JSON_OBJECTS = 1024
# Triton keeps dimensions as int64 but batches with 32-bit counts: anything larger is refused.
MAX_DIMENSION = 2**31 - 1
# Longest model name echoed in an error (a name can be 8 KB long).
ECHO_CHARS = 64
SHARED_MEMORY_PARAMETERS = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")
ALLOWED_OUTPUT_PARAMETERS = ("binary_data",)
ALLOWED_INPUT_PARAMETERS = ("binary_data_size",)
_VERSION = re.compile(r"^[0-9]{0,19}$")


class ScreenError(ValueError):
    """A request the screen refuses: ``status`` (HTTP) and ``grpc_code`` say how."""

    def __init__(self, message: str, status: int = 400, grpc_code: str = "INVALID_ARGUMENT"):
        super().__init__(message)
        self.status, self.grpc_code = status, grpc_code


def echo(name: str) -> str:
    return name if len(name) <= ECHO_CHARS else name[:ECHO_CHARS] + f"... ({len(name)} characters)"


@dataclass(frozen=True)
class ScreenPolicy:
    max_body_bytes: int
    # None: every model is public (a repository built before the builder recorded its entry points).
    public_models: frozenset[str] | None = None

    def check_model(self, name: str, version: str = "") -> None:
        if self.public_models is not None and name not in self.public_models:
            raise ScreenError(f"unknown model '{echo(name)}': inference is served for the pipelines "
                              f"({', '.join(sorted(self.public_models))})", 404, "NOT_FOUND")
        if not _VERSION.match(version):
            raise ScreenError(f"model version '{echo(version)}' is not a version number")

    def check_shape(self, input_name: str, shape: Iterable) -> int:
        """The element count of a well-formed shape, else ScreenError naming the input."""
        count = 1
        shape = list(shape)
        if not shape:
            raise ScreenError(f"input '{echo(input_name)}' has an empty shape")
        for dim in shape:
            if isinstance(dim, bool) or not isinstance(dim, int):
                raise ScreenError(f"input '{echo(input_name)}': shape {shape!r:.200} holds {dim!r:.40}, "
                                  "not a whole number")
            if dim < 1 or dim > MAX_DIMENSION:
                raise ScreenError(f"input '{echo(input_name)}': shape {shape!r:.200} has a dimension of {dim}; "
                                  f"every dimension must be between 1 and {MAX_DIMENSION}")
            count *= dim
            if count > self.max_body_bytes:
                raise ScreenError(f"input '{echo(input_name)}': shape {shape!r:.200} holds more elements than "
                                  f"a request of at most {self.max_body_bytes} bytes can carry")
        return count


def check_output_parameters(output_name: str, names: Iterable[str]) -> None:
    for name in names:
        if name == "classification":
            raise ScreenError(f"output '{echo(output_name)}': the classification extension is not served "
                              "(the pipelines return their top-k labels and scores themselves)")
        if name in SHARED_MEMORY_PARAMETERS:
            raise ScreenError(f"output '{echo(output_name)}': shared memory is not available on the public port")
        if name not in ALLOWED_OUTPUT_PARAMETERS:
            raise ScreenError(f"output '{echo(output_name)}': unknown parameter '{echo(name)}'")


def check_input_parameter_names(input_name: str, names: Iterable[str]) -> None:
    for name in names:
        if name in SHARED_MEMORY_PARAMETERS:
            raise ScreenError(f"input '{echo(input_name)}': shared memory is not available on the public port")
        if name not in ALLOWED_INPUT_PARAMETERS:
            raise ScreenError(f"input '{echo(input_name)}': unknown parameter '{echo(name)}'")


def check_request_parameter_names(names: Iterable[str]) -> None:
    """A request's own parameters may not carry the API key id the screen forwards (the router
    would take it for the caller's key), nor the deadline it forwards (the client's own deadline),
    nor the request's id on the cancel board (the screen's own)."""
    for name in names:
        if str(name).lower() == KEY_ID_PARAMETER:
            raise ScreenError(f"the request parameter '{KEY_ID_PARAMETER}' is reserved: send the key as "
                              f"`Authorization: Bearer <key>`")
        if str(name).lower() == CLIENT_DEADLINE_PARAMETER:
            raise ScreenError(f"the request parameter '{CLIENT_DEADLINE_PARAMETER}' is reserved: a gRPC "
                              f"call's own deadline is forwarded as it")
        if str(name).lower() == CLIENT_CANCEL_PARAMETER:
            raise ScreenError(f"the request parameter '{CLIENT_CANCEL_PARAMETER}' is reserved: the screen "
                              f"gives every request its own")


# ---------------------------------------------------------------------------- parameter values
# What Triton 2.51's HTTP endpoint (src/http_server.cc) reads each parameter as: AsBool (a JSON
# boolean), AsUInt (a whole number 0 <= x < 2**64); anything else is its 500 "Unable to parse".
def _boolean(value) -> bool:
    return type(value) is bool


def _whole_below(limit: int) -> Callable[[object], bool]:
    return lambda value: type(value) is int and 0 <= value < limit


@dataclass(frozen=True)
class ParameterRule:
    must_be: str  # what the error says the value must be
    accepts: Callable[[object], bool]


_BOOLEAN = ParameterRule("a boolean (true or false)", _boolean)
_UINT64 = ParameterRule("a whole number from 0 to 2**64 - 1", _whole_below(2**64))
# Per where the parameter sits: "request" (the request's own), "input", "output". Parameters not
# named here are not checked by value (on tensors, check_*_parameter_names refuses unknown ones).
PARAMETER_RULES: dict[str, dict[str, ParameterRule]] = {
    "request": {
        "sequence_id": ParameterRule("a whole number from 0 to 2**64 - 1, or a string",
                                     lambda value: isinstance(value, str) or _whole_below(2**64)(value)),
        "sequence_start": _BOOLEAN,
        "sequence_end": _BOOLEAN,
        "priority": _UINT64,
        # microseconds; Triton reads uint64 but keeps the deadline in signed nanoseconds
        "timeout": ParameterRule("a whole number of microseconds from 0 to 2**63 - 1", _whole_below(2**63)),
        "binary_data_output": _BOOLEAN,
    },
    "input": {"binary_data_size": ParameterRule("a whole number of bytes (0 to 2**64 - 1)", _whole_below(2**64))},
    "output": {"binary_data": _BOOLEAN},
}


def _shown(value) -> str:
    """A JSON value for an error, short and without recursing into it."""
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    return json.dumps(value)[:40]


def check_parameter_values(where: str, owner: str, parameters: dict) -> None:
    """Refuses a parameter whose value Triton could not read; ``where`` keys PARAMETER_RULES,
    ``owner`` names the tensor (or the request) in the error."""
    for name, rule in PARAMETER_RULES[where].items():
        if name in parameters and not rule.accepts(parameters[name]):
            raise ScreenError(f"{owner}: parameter '{name}' must be {rule.must_be}, "
                              f"not {_shown(parameters[name])}")


# ---------------------------------------------------------------------------- tensor data
@dataclass(frozen=True)
class ElementRule:
    """What each element of a datatype's JSON 'data' must be: one of ``types``, within
    ``low <= x < high`` where given."""
    must_be: str
    types: frozenset
    low: int | None = None
    high: int | None = None

    def accepts(self, value) -> bool:
        return type(value) in self.types and (self.low is None or self.low <= value < self.high)


# Triton's ReadDataFromJson reads elements with AsString, AsBool, AsUInt, AsInt, AsDouble; FP16,
# BF16 and unknown datatypes it refuses itself with a 400.
_UNSIGNED = ElementRule("a whole number from 0 to 2**64 - 1", frozenset({int}), 0, 2**64)
_SIGNED = ElementRule("a whole number from -2**63 to 2**63 - 1", frozenset({int}), -2**63, 2**63)
_FLOATING = ElementRule("a number", frozenset({int, float}))
DATA_ELEMENTS: dict[str, ElementRule] = {
    "BYTES": ElementRule("a string", frozenset({str})),
    "BOOL": ElementRule("a boolean (true or false)", frozenset({bool})),
    **{f"UINT{bits}": _UNSIGNED for bits in (8, 16, 32, 64)},
    **{f"INT{bits}": _SIGNED for bits in (8, 16, 32, 64)},
    "FP32": _FLOATING, "FP64": _FLOATING,
}


def check_tensor_data(input_name: str, datatype: str, data) -> None:
    """JSON tensor data: a list, nested or flat, whose every element fits ``datatype``. Walked
    without recursion (the JSON may nest up to MAX_JSON_DEPTH), one list at a time at C speed."""
    if not isinstance(data, list):
        raise ScreenError(f"input '{echo(input_name)}': 'data' must be a list")
    rule = DATA_ELEMENTS.get(datatype)
    pending = [data] if rule is not None else []
    while pending:
        values = pending.pop()
        kinds = set(map(type, values))
        if list in kinds:
            pending.extend(value for value in values if type(value) is list)
            kinds.discard(list)
            values = [value for value in values if type(value) is not list]
        if values and (not kinds <= rule.types
                       or rule.low is not None and not rule.low <= min(values) <= max(values) < rule.high):
            wrong = next(value for value in values if not rule.accepts(value))
            raise ScreenError(f"input '{echo(input_name)}': every element of 'data' of datatype {datatype} "
                              f"must be {rule.must_be}, not {_shown(wrong)}")


# ------------------------------------------------------------------------------------------ HTTP
def _reject_duplicates(pairs: list) -> dict:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ScreenError(f"the JSON object has the key '{echo(key)}' twice")
    return result


def parse_json_header(data: bytes) -> dict:
    if not data.strip():
        raise ScreenError("the request body is empty: an inference request is a JSON object with 'inputs'")
    if data.count(b"{") > MAX_JSON_OBJECTS:
        raise ScreenError(f"the request's JSON holds more than {MAX_JSON_OBJECTS} objects ('{{' counted, strings "
                          "included): send tensor data in binary form (tritonclient's default) or use gRPC")
    try:
        # C parser, linear time, no deeper than MAX_JSON_DEPTH whether brackets balance or not.
        header = json.loads(data, object_pairs_hook=_reject_duplicates)
    except ScreenError:
        raise
    except RecursionError:
        raise ScreenError(f"the request's JSON nests deeper than the screen's limit (about {MAX_JSON_DEPTH} "
                          "levels)") from None
    except ValueError as error:
        raise ScreenError(f"the request body is not valid JSON: {str(error)[:200]}") from None
    if not isinstance(header, dict):
        kind = {list: "an array", str: "a string", type(None): "null", bool: "a boolean"}.get(type(header), "a number")
        raise ScreenError(f"the request body must be a JSON object, not {kind}")
    return header


def _object(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ScreenError(f"{where} must be a JSON object")
    return value


def check_http_request(policy: ScreenPolicy, model: str, version: str, header_bytes: bytes,
                       binary_bytes: int) -> None:
    """An HTTP inference request: ``header_bytes`` is its JSON (the whole body, or the
    ``Inference-Header-Content-Length`` bytes), followed by ``binary_bytes`` of tensor data."""
    policy.check_model(model, version)
    header = parse_json_header(header_bytes)
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ScreenError("'inputs' must be a non-empty list of input tensors")
    binary_total = 0
    for tensor in inputs:
        if not isinstance(tensor, dict):
            raise ScreenError("each entry of 'inputs' must be a JSON object")
        name = tensor.get("name")
        if not isinstance(name, str):
            raise ScreenError("each input needs a 'name' (a string)")
        if not isinstance(tensor.get("datatype"), str):
            raise ScreenError(f"input '{echo(name)}' needs a 'datatype' (a string)")
        shape = tensor.get("shape")
        if not isinstance(shape, list):
            raise ScreenError(f"input '{echo(name)}' needs a 'shape' (a list of whole numbers)")
        policy.check_shape(name, shape)
        parameters = _object(tensor.get("parameters"), f"the parameters of input '{echo(name)}'")
        check_input_parameter_names(name, parameters)
        check_parameter_values("input", f"input '{echo(name)}'", parameters)
        if "binary_data_size" in parameters:
            if "data" in tensor:
                raise ScreenError(f"input '{echo(name)}' has both 'data' and binary_data_size")
            binary_total += parameters["binary_data_size"]
        elif "data" not in tensor:
            raise ScreenError(f"input '{echo(name)}' has neither 'data' nor binary_data_size")
        else:
            check_tensor_data(name, tensor["datatype"], tensor["data"])
    if binary_total != binary_bytes:
        raise ScreenError(f"the inputs' binary_data_size add up to {binary_total} bytes, but the request carries "
                          f"{binary_bytes} bytes after its JSON header")
    outputs = header.get("outputs", [])
    if not isinstance(outputs, list):
        raise ScreenError("'outputs' must be a list")
    for tensor in outputs:
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise ScreenError("each entry of 'outputs' must be a JSON object with a 'name'")
        parameters = _object(tensor.get("parameters"), f"the parameters of output '{echo(tensor['name'])}'")
        check_output_parameters(tensor["name"], parameters)
        check_parameter_values("output", f"output '{echo(tensor['name'])}'", parameters)
    parameters = _object(header.get("parameters"), "the request's 'parameters'")
    check_request_parameter_names(parameters)
    check_parameter_values("request", "the request", parameters)


# ------------------------------------------------------------------------------------------ gRPC
class WireError(ScreenError):
    pass


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise WireError("the gRPC message is truncated (varint)")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("the gRPC message has a malformed varint")


def fields(data: memoryview) -> Iterable[tuple[int, int, object]]:
    """(field number, wire type, value) of one protobuf message, without recursing: a
    length-delimited value is a memoryview into ``data`` (no copy), a varint an int."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            length, pos = _varint(data, pos)
            if pos + length > len(data):
                raise WireError("the gRPC message is truncated (a field is longer than the message)")
            value, pos = data[pos:pos + length], pos + length
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise WireError(f"the gRPC message has an unsupported wire type {wire}")
        if pos > len(data):
            raise WireError("the gRPC message is truncated")
        yield number, wire, value


def _text(value, what: str) -> str:
    if not isinstance(value, memoryview):
        raise WireError(f"{what} has the wrong wire type")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError(f"{what} is not valid UTF-8") from None


def _map_keys(entries: list, what: str) -> list[str]:
    """Keys of a protobuf map<string, ...> field (each entry: key = 1, value = 2)."""
    keys = []
    for entry in entries:
        if not isinstance(entry, memoryview):
            raise WireError(f"{what} has the wrong wire type")
        for number, _, value in fields(entry):
            if number == 1:
                keys.append(_text(value, what))
    return keys


def _int64s(value, wire: int) -> list[int]:
    """A repeated int64: packed (wire 2) or one varint (wire 0); two's complement → signed."""
    raw = [value] if wire == 0 else []
    if wire == 2:
        pos = 0
        while pos < len(value):
            item, pos = _varint(value, pos)
            raw.append(item)
    elif wire != 0:
        raise WireError("a shape has the wrong wire type")
    return [v - (1 << 64) if v >= 1 << 63 else v for v in raw]


# ModelInferRequest / InferInputTensor / InferRequestedOutputTensor field numbers (grpc_service.proto).
REQUEST_MODEL_NAME, REQUEST_MODEL_VERSION, REQUEST_PARAMETERS, REQUEST_INPUTS, REQUEST_OUTPUTS, REQUEST_RAW = (
    1, 2, 4, 5, 6, 7)
INPUT_NAME, INPUT_SHAPE, INPUT_PARAMETERS = 1, 3, 4
OUTPUT_NAME, OUTPUT_PARAMETERS = 1, 2


def check_grpc_request(policy: ScreenPolicy, message: bytes | memoryview) -> str:
    """A serialized ``ModelInferRequest``; returns the model name."""
    data = memoryview(message)
    model = version = ""
    inputs, outputs, parameters = [], [], []
    for number, _, value in fields(data):
        if number == REQUEST_MODEL_NAME:
            model = _text(value, "model_name")
        elif number == REQUEST_PARAMETERS:
            parameters.append(value)
        elif number == REQUEST_MODEL_VERSION:
            version = _text(value, "model_version")
        elif number == REQUEST_INPUTS:
            inputs.append(value)
        elif number == REQUEST_OUTPUTS:
            outputs.append(value)
    policy.check_model(model, version)
    check_request_parameter_names(_map_keys(parameters, "the request's parameters"))
    if not inputs:
        raise ScreenError("the request has no inputs")
    for tensor in inputs:
        if not isinstance(tensor, memoryview):
            raise WireError("an input has the wrong wire type")
        name, shape, parameters = "", [], []
        for number, wire, value in fields(tensor):
            if number == INPUT_NAME:
                name = _text(value, "an input's name")
            elif number == INPUT_SHAPE:
                shape += _int64s(value, wire)
            elif number == INPUT_PARAMETERS:
                parameters.append(value)
        policy.check_shape(name, shape)
        check_input_parameter_names(name, _map_keys(parameters, f"the parameters of input '{echo(name)}'"))
    for tensor in outputs:
        if not isinstance(tensor, memoryview):
            raise WireError("an output has the wrong wire type")
        name, parameters = "", []
        for number, _, value in fields(tensor):
            if number == OUTPUT_NAME:
                name = _text(value, "an output's name")
            elif number == OUTPUT_PARAMETERS:
                parameters.append(value)
        check_output_parameters(name, _map_keys(parameters, f"the parameters of output '{echo(name)}'"))
    return model


# ModelStreamInferResponse / ModelInferResponse / InferParameter field numbers (grpc_service.proto).
STREAM_ERROR_MESSAGE, STREAM_INFER_RESPONSE = 1, 2
RESPONSE_PARAMETERS = 4
PARAMETER_BOOL = 1
# Triton's mark of a request's last response on a stream (true; false on a decoupled model's others).
FINAL_RESPONSE_PARAMETER = "triton_final_response"


def is_final_response(message: bytes | memoryview) -> bool:
    """Whether a serialized ``ModelStreamInferResponse`` is the last one of its request: Triton
    marks it with ``triton_final_response`` (false on a decoupled model's partial responses); a
    response without the mark (a non-decoupled model's only response, an error for a request it could
    not start) is its request's last. A message we cannot read counts as the last, so a place is never
    kept by one."""
    try:
        for number, _, value in fields(memoryview(message)):
            if number != STREAM_INFER_RESPONSE or not isinstance(value, memoryview):
                continue
            for field, _, entry in fields(value):
                if field != RESPONSE_PARAMETERS or not isinstance(entry, memoryview):
                    continue
                key, parameter = "", None
                for part, _, item in fields(entry):
                    if part == 1 and isinstance(item, memoryview):
                        key = bytes(item).decode("utf-8", "replace")
                    elif part == 2:
                        parameter = item
                if key == FINAL_RESPONSE_PARAMETER and isinstance(parameter, memoryview):
                    return any(n == PARAMETER_BOOL and v == 1 for n, _, v in fields(parameter))
    except WireError:
        pass
    return True


# ------------------------------------------------------------------------------------------ answers
STUB_DEAD = re.compile(r"Stub process .*is not healthy|Failed to .*stub|stub process is not (healthy|alive)",
                       re.IGNORECASE)


def restarting_model_message(triton_message: str) -> str | None:
    """Triton's error for a request that met a dead Python stub (INTERNAL / 500) says nothing a client
    can act on: the supervisor is reloading that model, so the request is worth retrying."""
    if STUB_DEAD.search(triton_message):
        return "a model of this pipeline is restarting (its Python process died): retry shortly"
    return None
