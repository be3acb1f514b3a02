"""The /v1 frontend's request bytes in flight (issue 33 §2): a body that does not fit in what is
left of the budget, or of its client's share (nginx's address header), is a 503 in OpenAI's shape
with Retry-After, before its body is read; a body that fits is served, and its bytes are given back
with its answer. The aiohttp application over a loopback socket (no Triton)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from triton_pipelines.front.nginx_config import CLIENT_ADDRESS_HEADER
from triton_pipelines.front.places import Places

from tests.support.loopback_frontend import KEY, with_frontend


def post(port: int, size: int, client: str) -> tuple[int, dict, dict]:
    body = json.dumps({"model": "text_embedding", "input": "x" * size}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/embeddings", data=body, method="POST", headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json", CLIENT_ADDRESS_HEADER: client})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def test_a_body_past_the_clients_share_or_the_budget_is_503_and_its_bytes_are_never_kept():
    budget = Places(10_000, per_client=6_000)
    assert budget.try_take("10.0.0.1", 5_000)  # a request of 10.0.0.1's in flight
    status, headers, body = with_frontend(lambda port: post(port, 2_000, "10.0.0.1"), budget)
    assert status == 503 and headers.get("Retry-After") == "1"
    assert body["error"]["code"] == "service_unavailable"
    assert "request bytes in flight" in body["error"]["message"] and "this client" in body["error"]["message"]
    assert budget.taken == 5_000  # the refused request holds nothing
    # another address fits within the budget: it reaches the endpoint (no Triton here: its answer is
    # whatever the endpoint says, but not the byte budget's), and gives its bytes back
    status, _, body = with_frontend(lambda port: post(port, 2_000, "10.0.0.2"), budget)
    assert "request bytes in flight" not in json.dumps(body)
    assert budget.taken == 5_000 and budget.by_client == {"10.0.0.1": 5_000}
    assert budget.try_take("10.0.0.3", 5_000)  # now the whole budget is held
    status, _, body = with_frontend(lambda port: post(port, 10, "10.0.0.2"), budget)
    assert status == 503 and "request bytes in flight" in body["error"]["message"]
