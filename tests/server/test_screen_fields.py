"""Inference bodies whose fields Triton 2.51's HTTP endpoint cannot read (it answered 500 "Unable
to parse"), through the public HTTP port: each is refused by the request screen (screen.py's
PARAMETER_RULES and DATA_ELEMENTS) with 400 naming the field, and the next request is served."""

from __future__ import annotations

import json

import pytest

from tests.server import test_hostile_screen
from tests.server.test_hostile import error_of, post
from tests.server.test_hostile_screen import ONE_TEXT, infer_url

# test_hostile_screen's fixture `unharmed` (the server serves before and after, tritonserver never
# restarts), registered here as `screened`
screened = test_hostile_screen.unharmed


def with_fields(parameters: dict | None = None, output_parameters: dict | None = None,
                tensor: dict | None = None) -> bytes:
    body = {"inputs": [{**ONE_TEXT[0], **(tensor or {})}]}
    if output_parameters is not None:
        body["outputs"] = [{"name": "embedding", "parameters": output_parameters}]
    if parameters is not None:
        body["parameters"] = parameters
    return json.dumps(body).encode()


BAD_BODIES = [
    (with_fields(output_parameters={"binary_data": "yes"}), "'binary_data'"),
    (with_fields(output_parameters={"binary_data": 1}), "'binary_data'"),
    (with_fields(tensor={"data": None, "parameters": {"binary_data_size": "6"}}), "'binary_data_size'"),
    (with_fields({"binary_data_output": "yes"}), "'binary_data_output'"),
    (with_fields(tensor={"data": [5]}), "'data'"),
    (with_fields(tensor={"data": [[1, 2]], "shape": [1, 2]}), "'data'"),
    (with_fields(tensor={"data": ["1.5"], "datatype": "FP32"}), "'data'"),
    (with_fields(tensor={"data": [1], "datatype": "BOOL"}), "'data'"),
    (with_fields(tensor={"data": 5}), "'data' must be a list"),
    (with_fields({"sequence_id": -1}), "'sequence_id'"),
    (with_fields({"sequence_id": 1.5}), "'sequence_id'"),
    (with_fields({"sequence_id": 2**64}), "'sequence_id'"),
    (with_fields({"sequence_start": 1}), "'sequence_start'"),
    (with_fields({"sequence_end": "true"}), "'sequence_end'"),
    (with_fields({"priority": -1}), "'priority'"),
    (with_fields({"priority": "x"}), "'priority'"),
    (with_fields({"timeout": -1}), "'timeout'"),
    (with_fields({"timeout": 2**70}), "'timeout'"),
    (with_fields({"timeout": 1e300}), "'timeout'"),
]


def drop_data_for_binary(body: bytes) -> bytes:
    """A binary_data_size input carries no 'data' (the screen refuses both at once)."""
    request = json.loads(body)
    for tensor in request["inputs"]:
        if tensor.get("data", "") is None:
            del tensor["data"]
    return json.dumps(request).encode()


@pytest.mark.parametrize("body,field", BAD_BODIES, ids=[field + str(i) for i, (_, field) in enumerate(BAD_BODIES)])
def test_fields_triton_cannot_read_are_400_naming_the_field(screened, body, field):
    status, answer = post(infer_url(screened, "text_embedding"), drop_data_for_binary(body))
    assert status == 400 and field in error_of(answer), (status, answer[:300])
    # the neighbour request on the same model is served
    status, answer = post(infer_url(screened, "text_embedding"), json.dumps({"inputs": ONE_TEXT}).encode())
    assert status == 200 and len(json.loads(answer)["outputs"][0]["data"]) == 384


def test_legal_forms_of_the_same_fields_are_served(screened):
    for output_parameters in ({"binary_data": False}, None):
        body = with_fields({"binary_data_output": False, "priority": 0}, output_parameters)
        status, answer = post(infer_url(screened, "text_embedding"), body)
        assert status == 200 and len(json.loads(answer)["outputs"][0]["data"]) == 384, (status, answer[:300])
