"""The gRPC port's in-flight places, counted per request in the request screen (``screen_server.py``).

nginx's ``limit_conn`` counts an HTTP/2 stream from its HEADERS frame: a stream with no DATA held a
place, and one ``ModelStreamInfer`` stream carried any number of requests as one place. So the
screen counts gRPC requests itself: a ``ModelInfer`` request takes a place once its whole message
has arrived (refused at once when there is none: ``try_take``), and each request message of a
stream takes one when it arrives (the stream waits, unread, until there is one: ``take``) and gives
it back with that request's final response.

``Places(capacity, per_client)``: at most ``capacity`` places taken, at most ``per_client`` of them
by one client (its address; 0: no share). A place given back goes first to the longest-waiting
stream that may take it. Pure asyncio, one event loop; each screen replica has its own (its part of
the server's limit, ``limits.replica_part``).

The same class counts request **bytes** in flight (``request_bytes``: the byte budget beside the
count, issue 33): a request takes ``amount`` = its size, so a few large requests cannot hold memory
that a count of places would allow (one 64 MiB request costs ~5× its size across the screen,
tritonserver, a stub and /dev/shm). ``fits`` says whether an amount can ever be taken (a request
larger than a client's share never could: refused at once instead of waiting forever).
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque

from triton_pipelines.limits import client_share, replica_part


class Places:
    def __init__(self, capacity: int, per_client: int = 0):
        if capacity < 1 or per_client < 0:
            raise ValueError(f"capacity {capacity} and per-client share {per_client}: need capacity >= 1, share >= 0")
        self.capacity, self.per_client = capacity, per_client
        self.taken = 0
        self.by_client: Counter[str] = Counter()
        self._waiting: deque[tuple[str, int, asyncio.Future]] = deque()

    def fits(self, amount: int = 1) -> bool:
        """Whether ``amount`` could ever be taken by one client (within the capacity and the share)."""
        return amount <= self.capacity and (not self.per_client or amount <= self.per_client)

    def _may_take(self, client: str, amount: int = 1) -> bool:
        return (self.taken + amount <= self.capacity
                and (not self.per_client or self.by_client[client] + amount <= self.per_client))

    def _grant(self, client: str, amount: int = 1) -> None:
        self.taken += amount
        self.by_client[client] += amount

    def try_take(self, client: str, amount: int = 1) -> bool:
        """``amount`` places for ``client`` now, or False (the server or this client is at its limit)."""
        if amount < 0:
            raise ValueError(f"amount {amount}: need >= 0")
        if not self._may_take(client, amount):
            return False
        self._grant(client, amount)
        return True

    async def take(self, client: str, amount: int = 1) -> None:
        """``amount`` places for ``client``, waiting (first come, first served among waiters) until
        they are free. An amount that never ``fits`` raises ValueError instead of waiting forever."""
        if not self.fits(amount):
            raise ValueError(f"{amount} is more than a client may ever hold ({self.capacity}, share {self.per_client})")
        if not self._waiting and self.try_take(client, amount):
            return
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((client, amount, future))
        self._hand_out()  # the queue may have been blocked only by other clients' shares
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.give_back(client, amount)  # granted as it was cancelled: not kept
            else:
                self._forget(future)
            raise

    def give_back(self, client: str, count: int = 1) -> None:
        if count < 0 or self.by_client[client] < count:
            raise RuntimeError(f"client {client!r} gives back {count} places; it does not hold them ({self.by_client[client]} held)")
        self.taken -= count
        self.by_client[client] -= count
        if not self.by_client[client]:
            del self.by_client[client]
        self._hand_out()

    def waiting(self) -> int:
        return len(self._waiting)

    def _forget(self, future: asyncio.Future) -> None:
        self._waiting = deque(item for item in self._waiting if item[2] is not future)
        self._hand_out()

    def _hand_out(self) -> None:
        """Each free place to the first waiter that may take it (a waiter over its own share is
        skipped, not a wall for the others)."""
        kept: deque[tuple[str, int, asyncio.Future]] = deque()
        while self._waiting:
            client, amount, future = self._waiting.popleft()
            if future.done():
                continue
            if self._may_take(client, amount):
                self._grant(client, amount)
                future.set_result(None)
            else:
                kept.append((client, amount, future))
        self._waiting = kept


def bytes_overloaded_message(budget: Places) -> str:
    """The answer to a request whose body does not fit in the request bytes in flight (``budget``)."""
    share = f", or this client (its address) at its share of {budget.per_client / 2**20:g} MiB" if budget.per_client else ""
    return (f"the server holds its limit of {budget.capacity / 2**20:g} MiB of request bytes in flight{share}: "
            "retry shortly")


def byte_budget(total: int, per_client: int | None, max_body_bytes: int, replicas: int = 1, index: int = 0) -> Places:
    """This screen's part of the request bytes in flight (``limits.DEFAULT_MAX_INFLIGHT_BYTES``) and of a
    client's share, each at least ``max_body_bytes`` so that every legal request fits on its own."""
    share = client_share(total, per_client)
    return Places(max(replica_part(total, replicas, index), max_body_bytes),
                  max(replica_part(share, replicas, index), max_body_bytes) if share else 0)
