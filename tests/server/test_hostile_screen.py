"""Requests within every size limit that crashed tritonserver 2.51 or got a wrong answer from it,
through the public ports, on both protocols: each is refused with a clear error by the request
screen (screen.py) or the front (proxy.py), and tritonserver is never restarted."""

from __future__ import annotations

import json
import urllib.request
import zlib

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from triton_pipelines.client import InferenceServerException, TritonClient, text_tensor

from tests.support.router_helpers import metric, scrape
from tests.server.test_hostile import assert_serving, error_of, post

ONE_TEXT = [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["hi"]}]


def restarts(server) -> float:
    return metric(scrape(server.metrics_url), "launcher_tritonserver_restarts_total")


@pytest.fixture
def unharmed(triton_server):
    """The server serves before and after, and tritonserver never restarted in between."""
    before = restarts(triton_server)
    yield triton_server
    assert_serving(triton_server)
    assert restarts(triton_server) == before, "tritonserver was restarted: a request crashed it"


def infer_url(server, model: str) -> str:
    return f"http://{server.http_url}/v2/models/{model}/infer"


def grpc_request(model: str, shape=(1, 1), output: str | None = None, parameters: dict | None = None):
    request = service_pb2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="text", datatype="BYTES")
    tensor.shape.extend(shape)
    request.raw_input_contents.append(len(b"hi").to_bytes(4, "little") + b"hi")
    if output:
        requested = request.outputs.add(name=output)
        for key, value in (parameters or {}).items():
            requested.parameters[key].int64_param = value
    return request


def grpc_call(server, request, compression=None):
    with grpc.insecure_channel(server.grpc_url, compression=compression) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            return stub.ModelInfer(request, timeout=60), None
        except grpc.RpcError as error:
            return None, error


# ------------------------------------------------------------------------------------ crashers
@pytest.mark.parametrize("model,output", [("text_classification", "label"), ("text_classification", "score"),
                                          ("image_classification", "labels"), ("text_embedding", "embedding")])
def test_the_classification_extension_is_refused_on_every_output(unharmed, model, output):
    """Classification on a BYTES output killed tritonserver (SIGFPE) over HTTP and gRPC."""
    body = {"inputs": ONE_TEXT, "outputs": [{"name": output, "parameters": {"classification": 1}}]}
    status, answer = post(infer_url(unharmed, model), json.dumps(body).encode())
    assert status == 400 and "classification extension is not served" in error_of(answer)
    # escaped key, same meaning to every JSON parser
    escaped = json.dumps(body).replace('"classification"', '"\\u0063lassification"').encode()
    assert post(infer_url(unharmed, model), escaped)[0] == 400
    client = grpcclient.InferenceServerClient(unharmed.grpc_url)
    tensor = grpcclient.InferInput("text", [1, 1], "BYTES")
    tensor.set_data_from_numpy(text_tensor(["hi"]))
    with pytest.raises(InferenceServerException) as caught:
        client.infer(model, [tensor], outputs=[grpcclient.InferRequestedOutput(output, class_count=1)])
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT" and "classification" in caught.value.message()
    client.close()


def test_a_duplicate_key_cannot_hide_a_crasher_from_the_screen(unharmed):
    """Triton's parser takes the first of two equal keys, Python's the last: both are refused."""
    body = (b'{"inputs":[{"name":"text","shape":[1,1],"datatype":"BYTES","data":["hi"]}],'
            b'"outputs":[{"name":"label","parameters":{"classification":1}}],"outputs":[]}')
    status, answer = post(infer_url(unharmed, "text_classification"), body)
    assert status == 400 and "twice" in error_of(answer)


@pytest.mark.parametrize("opening", [b"[", b'{"a":'])
def test_unbalanced_nesting_under_the_json_limit_is_refused(unharmed, opening):
    """131,066 unclosed brackets in 128 KiB crashed tritonserver; objects nest the same way."""
    prefix = b'{"id":'
    body = prefix + opening * ((128 * 1024 - len(prefix)) // len(opening))
    assert len(body) <= 128 * 1024
    refusal = "nests deeper than" if opening == b"[" else "more than 1024 objects"
    status, answer = post(infer_url(unharmed, "text_embedding"), body)
    assert status == 400 and refusal in error_of(answer)
    # as the JSON header of a binary request too
    status, answer = post(infer_url(unharmed, "text_embedding"), body + b"x" * 10,
                          {"Inference-Header-Content-Length": str(len(body))})
    assert status == 400 and refusal in error_of(answer)


@pytest.mark.parametrize("compression", [grpc.Compression.Gzip, grpc.Compression.Deflate])
def test_compressed_grpc_messages_are_refused_before_triton_inflates_them(unharmed, compression):
    """1 MiB of gzip inflated to 1 GiB inside tritonserver (RSS 392 MB → 2,987 MB)."""
    request = grpc_request("text_embedding")
    request.raw_input_contents[0] = (8 * 2**20).to_bytes(4, "little") + bytes(8 * 2**20)
    _, error = grpc_call(unharmed, request, compression)
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED and "uncompressed" in error.details()


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "identity, gzip"])
def test_compressed_http_bodies_are_refused(unharmed, encoding):
    body = zlib.compress(json.dumps({"inputs": ONE_TEXT}).encode())
    status, answer = post(infer_url(unharmed, "text_embedding"), body, {"Content-Encoding": encoding})
    assert status == 415 and "uncompressed" in error_of(answer)


# ------------------------------------------------------------------------------------ client errors
@pytest.mark.parametrize("body,fragment", [
    (b'{"inputs": [', "not valid JSON"),
    (b"null", "must be a JSON object"),
    (b"", "body is empty"),
    (json.dumps({"inputs": [{**ONE_TEXT[0], "shape": [-1, 1]}]}).encode(), "every dimension"),
    (json.dumps({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES",
                             "parameters": {"binary_data_size": -1}}]}).encode(), "binary_data_size"),
    (json.dumps({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES",
                             "parameters": {"binary_data_size": "abc"}}]}).encode(), "binary_data_size"),
    (json.dumps({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES",
                             "parameters": {"binary_data_size": 3.5}}]}).encode(), "binary_data_size"),
    (json.dumps({"inputs": ONE_TEXT, "outputs": [{"name": "label", "parameters": {"classification": -1}}]}).encode(),
     "classification"),
])
def test_client_errors_are_400_not_500(unharmed, body, fragment):
    status, answer = post(infer_url(unharmed, "text_classification"), body)
    assert status == 400 and fragment in error_of(answer), (status, answer[:200])


def test_an_empty_body_is_refused_not_served_as_an_empty_text(unharmed):
    """Content-Length: 0 got the embedding of "" (and the label "greeting")."""
    for model in ("text_embedding", "text_classification"):
        status, answer = post(infer_url(unharmed, model), b"", {"Content-Length": "0"})
        assert status == 400 and "body is empty" in error_of(answer)


@pytest.mark.parametrize("shape", [[0, 1], [4294967296, 1], [4294967297, 1], [2**31, 1], [1, 4294967297]])
def test_dimensions_triton_would_truncate_to_32_bits_are_refused(unharmed, shape):
    """[4294967297, 1] with one element was served as batch 1; [0, 1] answered a 1-D output."""
    body = json.dumps({"inputs": [{**ONE_TEXT[0], "shape": shape}]}).encode()
    status, answer = post(infer_url(unharmed, "text_embedding"), body)
    assert status == 400 and "every dimension must be between 1 and" in error_of(answer)
    _, error = grpc_call(unharmed, grpc_request("text_embedding", shape=shape))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "every dimension" in error.details()


def test_long_urls_headers_and_model_names_get_their_own_errors(unharmed):
    """8-16 KB URLs or headers answered 503 "starting or restarting"; 6,000-8,100 character model
    names 405."""
    body = json.dumps({"inputs": ONE_TEXT}).encode()
    for length in (6000, 8100):
        status, answer = post(infer_url(unharmed, "m" * length), body)
        assert status == 404 and error_of(answer) == "not found", (length, status)
    # a request line over 8 KiB is refused before nginx picks a location: its own 414 page
    for url in (infer_url(unharmed, "m" * 12_000), infer_url(unharmed, "text_embedding") + "?" + "q" * 12_000):
        status, answer = post(url, body)
        assert status == 414 and b"restarting" not in answer
    status, answer = post(infer_url(unharmed, "text_embedding"), body, {"X-Padding": "p" * 12_000})
    assert status == 431 and "header is longer than" in error_of(answer)
    # a 7 KB header is under nginx's limit and still served: Triton never sees client headers it
    # does not need
    status, _ = post(infer_url(unharmed, "text_embedding"), body, {"X-Padding": "p" * 7_000})
    assert status == 200


# ------------------------------------------------------------------------------------ the public surface
@pytest.mark.parametrize("model", ["text_tokenizer", "text_encoder", "whisper_decoder", "intent_classifier",
                                   "audio_features"])
def test_internal_models_are_not_served_on_the_public_ports(unharmed, model):
    """Only the pipelines and the router; their steps answer 404 / NOT_FOUND (their metadata stays
    readable for tools like perf_analyzer and Model Analyzer)."""
    status, answer = post(infer_url(unharmed, model), json.dumps({"inputs": ONE_TEXT}).encode())
    assert status == 404 and f"unknown model '{model}'" in error_of(answer)
    status, _ = post(f"http://{unharmed.http_url}/v2/models/text_encoder/versions/2/infer",
                     json.dumps({"inputs": ONE_TEXT}).encode())
    assert status == 404
    _, error = grpc_call(unharmed, grpc_request(model))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    with urllib.request.urlopen(f"http://{unharmed.http_url}/v2/models/{model}/config", timeout=10) as response:
        assert json.loads(response.read())["name"] == model
    # every pipeline is
    client = TritonClient("grpc", unharmed.grpc_url)
    assert client.infer("text_embedding_batch", {"text": text_tensor(["x"])})["embedding"].shape == (1, 384)
    client.close()


def test_good_requests_pass_the_screen_unchanged(unharmed):
    """The screen forwards bytes: outputs equal Triton's own, binary and JSON, both protocols."""
    texts = ["How do I reset my password?", "", "ünïcödé ✓", "x" * 5000]
    http = TritonClient("http", unharmed.http_url)
    grpc_client = TritonClient("grpc", unharmed.grpc_url)
    from_http = http.infer("text_embedding", {"text": text_tensor(texts)})["embedding"]
    from_grpc = grpc_client.infer("text_embedding", {"text": text_tensor(texts)})["embedding"]
    status, answer = post(infer_url(unharmed, "text_embedding"), json.dumps(
        {"inputs": [{"name": "text", "shape": [4, 1], "datatype": "BYTES", "data": texts}]}).encode())
    assert status == 200
    from_json = np.array(json.loads(answer)["outputs"][0]["data"], np.float32).reshape(4, -1)
    np.testing.assert_allclose(from_http, from_grpc, atol=1e-6)
    np.testing.assert_allclose(from_json, from_http, atol=1e-6)
    http.close()
    grpc_client.close()
