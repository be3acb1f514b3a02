"""The gRPC port's in-flight places (front/places.py) and how a stream's response says its request
is done (screen.is_final_response), without a server."""

from __future__ import annotations

import asyncio

import pytest
from tritonclient.grpc import service_pb2

from triton_pipelines.front.places import Places
from triton_pipelines.front.screen import is_final_response
from triton_pipelines.limits import client_share, replica_part


def run(coroutine):
    return asyncio.run(coroutine)


def test_try_take_refuses_past_the_capacity_and_past_a_clients_share():
    places = Places(4, per_client=2)
    assert [places.try_take("a") for _ in range(3)] == [True, True, False]  # a's share
    assert [places.try_take("b") for _ in range(3)] == [True, True, False]  # capacity
    assert places.taken == 4
    places.give_back("a")
    assert not places.try_take("b") and places.try_take("a")


def test_no_share_lets_one_client_take_everything():
    places = Places(3)
    assert [places.try_take("a") for _ in range(4)] == [True, True, True, False]


def test_a_place_given_back_goes_to_the_first_waiter():
    async def scenario():
        places = Places(1)
        places.try_take("a")
        order = []

        async def waiter(name):
            await places.take(name)
            order.append(name)

        tasks = [asyncio.ensure_future(waiter(name)) for name in ("b", "c")]
        await asyncio.sleep(0)
        assert places.waiting() == 2 and not order
        places.give_back("a")
        await asyncio.sleep(0)
        assert order == ["b"] and places.by_client == {"b": 1}
        # a free place is not taken past a waiter: the waiter has it
        assert not places.try_take("d")
        places.give_back("b")
        await asyncio.gather(*tasks)
        assert order == ["b", "c"] and places.taken == 1
    run(scenario())


def test_a_waiter_over_its_share_does_not_block_the_others():
    async def scenario():
        places = Places(3, per_client=1)
        places.try_take("a")
        held_back = asyncio.ensure_future(places.take("a"))  # a is at its share: waits
        await asyncio.sleep(0)
        other = asyncio.ensure_future(places.take("b"))  # b may take one now
        await asyncio.wait_for(other, 1)
        assert not held_back.done() and places.by_client == {"a": 1, "b": 1}
        places.give_back("a")
        await asyncio.wait_for(held_back, 1)
        assert places.by_client == {"a": 1, "b": 1}
    run(scenario())


def test_a_cancelled_waiter_keeps_no_place():
    async def scenario():
        places = Places(1)
        places.try_take("a")
        waiter = asyncio.ensure_future(places.take("b"))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert places.waiting() == 0
        places.give_back("a")
        assert places.taken == 0
        # granted and cancelled before it ran: the place is given back, not lost
        places.try_take("a")
        granted = asyncio.ensure_future(places.take("b"))
        await asyncio.sleep(0)
        places.give_back("a")  # hands the place to b's future
        granted.cancel()
        with pytest.raises(asyncio.CancelledError):
            await granted
        assert places.taken == 0 and not places.by_client
    run(scenario())


def test_giving_back_more_than_held_is_an_error():
    places = Places(2)
    places.try_take("a")
    places.give_back("a")
    with pytest.raises(RuntimeError, match="does not hold"):
        places.give_back("a")
    with pytest.raises(ValueError):
        Places(0)


def test_the_limits_split_over_replicas_add_up_and_the_default_share_is_half():
    assert client_share(256, None) == 128 and client_share(256, 0) == 0 and client_share(1, None) == 1
    for total, replicas in ((256, 1), (256, 3), (7, 2), (32, 4)):
        assert sum(replica_part(total, replicas, i) for i in range(replicas)) == total
    assert [replica_part(1, 3, i) for i in range(3)] == [1, 1, 1]  # every screen may serve one
    assert replica_part(0, 3, 1) == 0  # no share stays no share


def stream_response(final: bool | None, error: str = "") -> bytes:
    response = service_pb2.ModelStreamInferResponse(error_message=error)
    response.infer_response.model_name = "speech_recognition_stream"
    response.infer_response.raw_output_contents.append(b"\x00" * 64)
    if final is not None:
        response.infer_response.parameters["triton_final_response"].bool_param = final
    response.infer_response.parameters["other"].string_param = "triton_final_response"
    return response.SerializeToString()


@pytest.mark.parametrize("final, expected", [(True, True), (False, False), (None, True)])
def test_the_final_response_mark(final, expected):
    """Triton's triton_final_response: false on a decoupled model's partial responses; a response
    without it (a non-decoupled model's one response) ends its request."""
    assert is_final_response(stream_response(final)) is expected


def test_an_error_response_and_an_unreadable_one_end_their_request():
    assert is_final_response(service_pb2.ModelStreamInferResponse(error_message="failed").SerializeToString())
    assert is_final_response(b"\x12\xff\xff")  # truncated: never keeps a place


def test_amounts_count_bytes_within_the_capacity_and_each_clients_share():
    budget = Places(100, per_client=60)
    assert budget.try_take("a", 50)
    assert not budget.try_take("a", 20)  # over a's share of 60
    assert budget.try_take("b", 50)
    assert not budget.try_take("c", 1)  # over the capacity
    assert budget.fits(60) and not budget.fits(61) and not Places(100).fits(101)
    budget.give_back("a", 50)
    assert budget.taken == 50 and budget.by_client == {"b": 50}


def test_a_waiting_amount_is_granted_when_enough_is_given_back_and_never_if_it_cannot_fit():
    async def scenario():
        budget = Places(100, per_client=100)
        assert budget.try_take("a", 80)
        large = asyncio.ensure_future(budget.take("b", 50))
        small = asyncio.ensure_future(budget.take("c", 10))  # fits now: not held up by the large one
        await asyncio.sleep(0)
        assert small.done() and not large.done()
        budget.give_back("a", 80)
        await asyncio.sleep(0)
        assert large.done() and budget.taken == 60
        with pytest.raises(ValueError, match="more than a client may ever hold"):
            await budget.take("d", 101)
    asyncio.run(scenario())
