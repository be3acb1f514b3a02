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
                                     check_http_request, restarting_model_message)

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
