"""The request screen's checks (triton_pipelines.front.screen), without a server: what Triton 2.51 must
never read, on both protocols, and that well-formed requests from tritonclient always pass."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import tritonclient.http as httpclient
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from triton_pipelines.front.screen import (MAX_DIMENSION, ScreenError, ScreenPolicy, check_grpc_request,
                                     check_http_request, check_request_parameter_names,
                                     restarting_model_message)

POLICY = ScreenPolicy(max_body_bytes=64 * 2**20, public_models=frozenset({"text_embedding", "router"}))


def http_request(outputs=None, binary=True):
    text = httpclient.InferInput("text", [2, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"hello"], [b"world"]], dtype=object), binary_data=binary)
    body, json_size = httpclient.InferenceServerClient.generate_request_body([text], outputs=outputs)
    json_size = len(body) if json_size is None else json_size
    return body[:json_size], len(body) - json_size


def grpc_request(model="text_embedding", shape=(2, 1), output_parameters=None) -> bytes:
    request = service_pb2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="text", datatype="BYTES")
    tensor.shape.extend(shape)
    request.raw_input_contents.append(b"\x05\x00\x00\x00hello" * 2)
    if output_parameters is not None:
        output = request.outputs.add(name="embedding")
        for key, value in output_parameters.items():
            output.parameters[key].int64_param = value
    return request.SerializeToString()


def refused(call, *fragments: str, status: int = 400) -> ScreenError:
    with pytest.raises(ScreenError) as caught:
        call()
    message = str(caught.value)
    assert caught.value.status == status and all(f in message for f in fragments), message
    return caught.value


# ------------------------------------------------------------------------------------------ HTTP
@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_requests_pass(binary):
    header, binary_bytes = http_request(outputs=[httpclient.InferRequestedOutput("embedding", binary_data=True)],
                                        binary=binary)
    check_http_request(POLICY, "text_embedding", "", header, binary_bytes)
    check_http_request(POLICY, "text_embedding", "1", header, binary_bytes)


def test_classification_is_refused_on_every_output_however_the_key_is_spelled():
    header, size = http_request(outputs=[httpclient.InferRequestedOutput("embedding", class_count=3)])
    refused(lambda: check_http_request(POLICY, "text_embedding", "", header, size), "classification extension")
    spelled = json.dumps(json.loads(header)).replace('"classification"', '"\\u0063lassification"').encode()
    refused(lambda: check_http_request(POLICY, "text_embedding", "", spelled, size), "classification extension")


def test_duplicate_keys_are_refused_so_no_parser_sees_another_request():
    body = (b'{"inputs":[{"name":"text","shape":[1,1],"datatype":"BYTES","data":["hi"]}],'
            b'"outputs":[{"name":"label","parameters":{"classification":1}}],"outputs":[]}')
    refused(lambda: check_http_request(POLICY, "text_embedding", "", body, 0), "key 'outputs' twice")


@pytest.mark.parametrize("body,fragment", [
    (b'{"id":' + b"[" * 131_066, "nests deeper"),                   # unbalanced, the reported crasher
    (b'{"id":' + b'{"a":' * 40_000, "more than 1024 objects"),       # objects: refused by their count
    (b'{"id":' + b'{"a":' * 1000 + b"[" * 2000, "nests deeper"),     # objects and arrays, under the count
    (b'{"id":' + b"[" * 1100 + b"]" * 1100 + b"}", "nests deeper"),  # balanced, over the limit
])
def test_deep_nesting_is_refused_without_recursion(body, fragment):
    refused(lambda: check_http_request(POLICY, "text_embedding", "", body, 0), fragment)


def test_a_json_of_many_objects_is_refused_before_it_is_parsed():
    """43,000 empty objects in 128 KiB cost the screen's parser 20 ms: refused from a byte count."""
    body = b'{"inputs":[' + b",".join([b"{}"] * 43_000) + b"]}"
    started = time.process_time()
    refused(lambda: check_http_request(POLICY, "text_embedding", "", body, 0), "more than 1024 objects", "binary")
    assert time.process_time() - started < 0.005
    many = json.dumps({"inputs": [{"name": f"t{i}", "shape": [1, 1], "datatype": "BYTES", "data": ["{x}"],
                                   "parameters": {}} for i in range(300)]}).encode()
    check_http_request(POLICY, "text_embedding", "", many, 0)  # 600 objects and 300 braces in strings pass


def test_nesting_a_request_may_need_passes_and_brackets_inside_strings_do_not_count():
    value = "x"
    for _ in range(100):
        value = [value]
    body = json.dumps({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}],
                       "parameters": {"deep": value}}).encode()
    check_http_request(POLICY, "text_embedding", "", body, 0)
    text = '[' * 5000 + '\\"' + '{' * 1000
    body = json.dumps({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}).encode()
    check_http_request(POLICY, "text_embedding", "", body, 0)


@pytest.mark.parametrize("body,fragment", [
    (b"", "body is empty"), (b"   ", "body is empty"), (b"null", "not null"), (b"[1]", "not an array"),
    (b'"x"', "not a string"), (b'{"inputs":', "not valid JSON"), (b"\xff\xfe", "not valid JSON"),
    (b'{"inputs":[]}', "non-empty list"), (b'{"inputs":{}}', "non-empty list"), (b'{"inputs":[1]}', "JSON object"),
    (b'{"inputs":[{"shape":[1,1],"datatype":"BYTES","data":["x"]}]}', "needs a 'name'"),
    (b'{"inputs":[{"name":"text","datatype":"BYTES","data":["x"]}]}', "needs a 'shape'"),
    (b'{"inputs":[{"name":"text","shape":[1,1],"data":["x"]}]}', "needs a 'datatype'"),
    (b'{"inputs":[{"name":"text","shape":[1,1],"datatype":"BYTES"}]}', "neither 'data' nor binary_data_size"),
    (b'{"inputs":[{"name":"text","shape":[1,1],"datatype":"BYTES","data":["x"]}],"outputs":{}}', "'outputs' must"),
    (b'{"inputs":[{"name":"text","shape":[1,1],"datatype":"BYTES","data":["x"]}],"parameters":[]}', "parameters"),
])
def test_malformed_bodies_are_client_errors(body, fragment):
    refused(lambda: check_http_request(POLICY, "text_embedding", "", body, 0), fragment)


@pytest.mark.parametrize("shape", [[0, 1], [-1, 1], [4294967296, 1], [4294967297, 1], [MAX_DIMENSION + 1],
                                   [1, True], [1.0, 1], ["1", 1], [], [2**20, 2**20]])
def test_shapes_triton_would_truncate_or_misread_are_refused(shape):
    body = json.dumps({"inputs": [{"name": "text", "shape": shape, "datatype": "BYTES", "data": ["x"]}]}).encode()
    refused(lambda: check_http_request(POLICY, "text_embedding", "", body, 0), "input 'text'")
    if all(type(d) is int for d in shape):  # what protobuf can carry
        refused(lambda: check_grpc_request(POLICY, grpc_request(shape=shape)), "input 'text'")


@pytest.mark.parametrize("size", [-1, "abc", 3.5, True, None])
def test_binary_data_size_must_be_a_whole_number_of_bytes(size):
    body = json.dumps({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES",
                                   "parameters": {"binary_data_size": size}}]}).encode()
    refused(lambda: check_http_request(POLICY, "text_embedding", "", body, 6), "binary_data_size")


def body_with(parameters=None, output_parameters=None, tensor=None) -> bytes:
    """One JSON text input, with request, output or input fields set."""
    body = {"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["x"], **(tensor or {})}]}
    if output_parameters is not None:
        body["outputs"] = [{"name": "embedding", "parameters": output_parameters}]
    if parameters is not None:
        body["parameters"] = parameters
    return json.dumps(body).encode()


@pytest.mark.parametrize("value", ["yes", 1, 0, None, [True]])
def test_binary_data_of_an_output_must_be_a_boolean(value):
    refused(lambda: check_http_request(POLICY, "text_embedding", "", body_with(output_parameters={
        "binary_data": value}), 0), "output 'embedding'", "binary_data", "boolean")


@pytest.mark.parametrize("value", [True, False])
def test_binary_data_booleans_pass(value):
    check_http_request(POLICY, "text_embedding", "", body_with(output_parameters={"binary_data": value}), 0)
    check_http_request(POLICY, "text_embedding", "", body_with({"binary_data_output": value}), 0)


@pytest.mark.parametrize("name,value", [
    ("binary_data_output", "yes"), ("binary_data_output", 1),
    ("sequence_id", -1), ("sequence_id", 1.5), ("sequence_id", 2**64), ("sequence_id", True), ("sequence_id", None),
    ("sequence_start", 1), ("sequence_start", "true"), ("sequence_end", 0), ("sequence_end", None),
    ("priority", -1), ("priority", "x"), ("priority", 1.5), ("priority", 2**64), ("priority", True),
    ("timeout", -1), ("timeout", 2**70), ("timeout", 1e300), ("timeout", 2**63), ("timeout", "10"), ("timeout", False),
])
def test_request_parameters_triton_cannot_read_are_refused_by_name(name, value):
    error = refused(lambda: check_http_request(POLICY, "text_embedding", "", body_with({name: value}), 0),
                    f"parameter '{name}'")
    assert error.grpc_code == "INVALID_ARGUMENT"


@pytest.mark.parametrize("parameters", [
    {"sequence_id": 0}, {"sequence_id": 2**64 - 1}, {"sequence_id": "session-7"}, {"sequence_id": ""},
    {"sequence_id": 5, "sequence_start": True, "sequence_end": False},
    {"priority": 0}, {"priority": 2**64 - 1}, {"timeout": 0}, {"timeout": 2**63 - 1},
    {"binary_data_output": False}, {"other": 1.5},
])
def test_legal_request_parameters_pass(parameters):
    check_http_request(POLICY, "text_embedding", "", body_with(parameters), 0)


def test_binary_data_size_names_its_range_and_the_largest_passes_the_value_check():
    refused(lambda: check_http_request(POLICY, "text_embedding", "", json.dumps({"inputs": [
        {"name": "text", "shape": [1, 1], "datatype": "BYTES", "parameters": {"binary_data_size": 2**64}}]}).encode(),
        0), "input 'text'", "parameter 'binary_data_size'", "2**64 - 1")
    refused(lambda: check_http_request(POLICY, "text_embedding", "", json.dumps({"inputs": [
        {"name": "text", "shape": [1, 1], "datatype": "BYTES", "parameters": {"binary_data_size": 2**64 - 1}}]}).encode(),
        0), "add up to")  # a well-typed size, then the sizes' own check


@pytest.mark.parametrize("datatype,data", [
    ("BYTES", [5]), ("BYTES", [["x"], [5]]), ("BYTES", [[None]]), ("BYTES", [True]), ("BYTES", [{"a": "x"}]),
    ("FP32", ["1.5"]), ("FP32", [[1.0], [True]]), ("FP64", [None]),
    ("INT64", [1.5]), ("INT64", ["1"]), ("INT32", [True]), ("INT64", [2**63]), ("INT8", [-2**63 - 1]),
    ("UINT8", [-1]), ("UINT64", [2**64]), ("UINT32", [1.0]),
    ("BOOL", [1]), ("BOOL", ["true"]), ("BOOL", [[False], [0]]),
])
def test_tensor_data_elements_must_fit_the_datatype(datatype, data):
    refused(lambda: check_http_request(POLICY, "text_embedding", "", body_with(tensor={
        "datatype": datatype, "data": data, "shape": [len(data), 1]}), 0), "input 'text'", "'data'", datatype)


@pytest.mark.parametrize("data", [5, "x", {"a": 1}, None])
def test_tensor_data_must_be_a_list(data):
    refused(lambda: check_http_request(POLICY, "text_embedding", "", body_with(tensor={"data": data}), 0),
            "input 'text'", "'data' must be a list")


@pytest.mark.parametrize("datatype,data", [
    ("BYTES", ["x", ""]), ("BYTES", [["x"], ["y"]]), ("FP32", [1.5, 2]), ("FP64", [[1e300], [-0.0]]),
    ("INT64", [-2**63, 2**63 - 1]), ("INT8", [1, -1]), ("UINT64", [0, 2**64 - 1]), ("BOOL", [True, False]),
    ("FP16", ["not read"]), ("BF16", [1]), ("NOTATYPE", [{}]),  # Triton answers these with its own 400
])
def test_tensor_data_that_fits_the_datatype_passes(datatype, data):
    check_http_request(POLICY, "text_embedding", "", body_with(tensor={"datatype": datatype, "data": data,
                                                                       "shape": [2, 1]}), 0)


def test_deeply_nested_tensor_data_is_walked_without_recursion():
    def nested(leaf: bytes, depth: int = 800) -> bytes:
        return (b'{"inputs":[{"name":"text","shape":[1,1],"datatype":"BYTES","data":' + b"[" * depth + leaf
                + b"]" * depth + b"}]}")
    check_http_request(POLICY, "text_embedding", "", nested(b'"x"'), 0)
    refused(lambda: check_http_request(POLICY, "text_embedding", "", nested(b"5"), 0), "must be a string")
    deep_object = nested(b'{"a":' + b"[" * 400 + b"]" * 400 + b"}", 400)  # named in the error, not dumped
    refused(lambda: check_http_request(POLICY, "text_embedding", "", deep_object, 0), "not an object")


def test_binary_sizes_must_add_up_to_what_follows_the_header():
    header, size = http_request()
    refused(lambda: check_http_request(POLICY, "text_embedding", "", header, size + 1), "add up to")


def test_shared_memory_and_unknown_tensor_parameters_are_refused():
    for parameters, fragment in (({"shared_memory_region": "r"}, "shared memory"), ({"other": 1}, "unknown parameter")):
        body = json.dumps({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["x"],
                                       "parameters": parameters}]}).encode()
        refused(lambda: check_http_request(POLICY, "text_embedding", "", body, 0), fragment)
        body = json.dumps({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}],
                           "outputs": [{"name": "embedding", "parameters": parameters}]}).encode()
        refused(lambda: check_http_request(POLICY, "text_embedding", "", body, 0), fragment)


def test_only_public_models_are_served_and_long_names_are_not_echoed():
    header, size = http_request()
    error = refused(lambda: check_http_request(POLICY, "text_encoder", "", header, size), "unknown model 'text_encoder'",
                    status=404)
    assert error.grpc_code == "NOT_FOUND"
    error = refused(lambda: check_http_request(POLICY, "x" * 8000, "", header, size), "8000 characters", status=404)
    assert len(str(error)) < 400
    refused(lambda: check_http_request(POLICY, "text_embedding", "1x", header, size), "not a version number")
    check_http_request(ScreenPolicy(max_body_bytes=2**20), "text_encoder", "", header, size)  # no allow-list


# ------------------------------------------------------------------------------------------ gRPC
def test_grpc_requests_pass_and_name_their_model():
    assert check_grpc_request(POLICY, grpc_request()) == "text_embedding"
    assert check_grpc_request(POLICY, grpc_request(output_parameters={"binary_data": 1})) == "text_embedding"


def test_grpc_classification_unknown_models_and_bad_shapes_are_refused():
    refused(lambda: check_grpc_request(POLICY, grpc_request(output_parameters={"classification": 1})),
            "classification extension")
    refused(lambda: check_grpc_request(POLICY, grpc_request(model="whisper_decoder")), "unknown model", status=404)
    for shape in ([0, 1], [-1, 1], [4294967297, 1]):
        refused(lambda: check_grpc_request(POLICY, grpc_request(shape=shape)), "every dimension")


@given(st.text(max_size=20), st.lists(st.integers(min_value=-2**63, max_value=2**63 - 1), max_size=4),
       st.dictionaries(st.text(max_size=15), st.integers(min_value=-5, max_value=5), max_size=3))
@settings(max_examples=300, deadline=None)
def test_grpc_wire_reading_agrees_with_protobuf(model, shape, parameters):
    """The hand-written wire reader sees the model, shapes and output parameters protobuf sees."""
    message = grpc_request(model=model, shape=shape, output_parameters=parameters)
    policy = ScreenPolicy(max_body_bytes=2**40)
    expected_ok = (bool(shape) and all(1 <= d <= MAX_DIMENSION for d in shape)
                   and int(np.prod([float(d) for d in shape] or [0])) <= 2**40
                   and all(k == "binary_data" for k in parameters))
    try:
        assert check_grpc_request(policy, message) == model
        assert expected_ok
    except ScreenError as error:
        assert not expected_ok, str(error)


@given(st.binary(max_size=300))
@settings(max_examples=500, deadline=None)
def test_arbitrary_bytes_are_refused_cleanly(data):
    for call in (lambda: check_grpc_request(POLICY, data), lambda: check_http_request(POLICY, "router", "", data, 0)):
        try:
            call()
        except ScreenError:
            pass


def test_a_dead_stub_error_becomes_a_retryable_answer():
    message = ("in ensemble 'text_embedding', Failed to process the request(s) for model 'text_tokenizer_0_0', "
               "message: Stub process 'text_tokenizer_0_0' is not healthy.")
    assert "retry" in restarting_model_message(message)
    assert restarting_model_message("invalid input: input 'text'[0] is not valid UTF-8") is None


def test_the_forwarded_deadline_parameter_is_reserved():
    from triton_pipelines.limits import CLIENT_DEADLINE_PARAMETER

    refused(lambda: check_request_parameter_names([CLIENT_DEADLINE_PARAMETER.upper()]), "reserved",
            CLIENT_DEADLINE_PARAMETER)


def test_the_cancel_board_id_parameter_is_reserved():
    from triton_pipelines.limits import CLIENT_CANCEL_PARAMETER

    refused(lambda: check_request_parameter_names([CLIENT_CANCEL_PARAMETER.upper()]), "reserved",
            CLIENT_CANCEL_PARAMETER)
