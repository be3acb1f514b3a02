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
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque


class Places:
    def __init__(self, capacity: int, per_client: int = 0):
        if capacity < 1 or per_client < 0:
            raise ValueError(f"capacity {capacity} and per-client share {per_client}: need capacity >= 1, share >= 0")
        self.capacity, self.per_client = capacity, per_client
        self.taken = 0
        self.by_client: Counter[str] = Counter()
        self._waiting: deque[tuple[str, asyncio.Future]] = deque()

    def _may_take(self, client: str) -> bool:
        return self.taken < self.capacity and (not self.per_client or self.by_client[client] < self.per_client)

    def _grant(self, client: str) -> None:
        self.taken += 1
        self.by_client[client] += 1

    def try_take(self, client: str) -> bool:
        """A place for ``client`` now, or False (the server or this client is at its limit)."""
        if not self._may_take(client):
            return False
        self._grant(client)
        return True

    async def take(self, client: str) -> None:
        """A place for ``client``, waiting (first come, first served among waiters) until there is one."""
        if not self._waiting and self.try_take(client):
            return
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((client, future))
        self._hand_out()  # the queue may have been blocked only by other clients' shares
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.give_back(client)  # granted as it was cancelled: not kept
            else:
                self._forget(future)
            raise

    def give_back(self, client: str, count: int = 1) -> None:
        for _ in range(count):
            if self.by_client[client] <= 0:
                raise RuntimeError(f"client {client!r} gives back a place it does not hold")
            self.taken -= 1
            self.by_client[client] -= 1
            if not self.by_client[client]:
                del self.by_client[client]
        self._hand_out()

    def waiting(self) -> int:
        return len(self._waiting)

    def _forget(self, future: asyncio.Future) -> None:
        self._waiting = deque(item for item in self._waiting if item[1] is not future)
        self._hand_out()

    def _hand_out(self) -> None:
        """Each free place to the first waiter that may take it (a waiter over its own share is
        skipped, not a wall for the others)."""
        kept: deque[tuple[str, asyncio.Future]] = deque()
        while self._waiting:
            client, future = self._waiting.popleft()
            if future.done():
                continue
            if self._may_take(client):
                self._grant(client)
                future.set_result(None)
            else:
                kept.append((client, future))
        self._waiting = kept
