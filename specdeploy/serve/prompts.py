"""Prompts are made off the event loop: chat templates are the artifact's code and tokenizing takes time, and while
either runs on the loop no other client (not even /health) is answered.

Each job runs in a daemon thread of its own (a thread cannot be stopped, and a pool's threads are joined at
exit: a template that never ends would hold the process), at most ``workers`` at once. Clients share the slots
fairly, addresses first: a free slot goes to the waiting address with the fewest jobs running (among equals, the one
served least recently), and at that address to the client (its API key, or its connection) with the fewest running,
served least recently. So one client's many slow renders cannot put another client's plain completion behind all of
them, whether the other is elsewhere or behind the same NAT or proxy, and a client that presents many keys from one
address shares that address's turn. A job's own limit is its work's (a
template's CPU time, in ``runtime.chat``; a prompt's characters, in ``Pipeline``); the wait here, from the
moment the job starts, is a wall-clock backstop ``WALL_FACTOR`` times longer, for a machine too busy to run it.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, deque
from collections.abc import Callable
from typing import TypeVar

from ..runtime.chat import WALL_FACTOR, WALL_GRACE

T = TypeVar("T")


class PromptTimeout(TimeoutError):
    """A job that did not finish within the wall-clock backstop."""


Client = tuple[str, str]  # (address, who at that address)


class PromptWorkers:
    def __init__(self, seconds: float = 10.0, workers: int = 4):
        self.seconds, self.workers = seconds, workers
        self.backstop = seconds * WALL_FACTOR + WALL_GRACE
        self._free = workers
        self._waiting: dict[Client, deque[asyncio.Future]] = {}  # client -> its jobs waiting; in turn order
        self._running: Counter[str | Client] = Counter()  # client, and address -> their jobs holding a slot
        self._served: dict[str | Client, int] = {}  # client, and address -> when last given a slot (a count of slots)
        self._given = 0

    async def run(self, job: Callable[[], T], client: str | Client = "") -> T:
        """``job()``'s result, computed in a thread once ``client``'s turn comes (an address, or (address, who there));
        its exception re-raised here; ``PromptTimeout`` past the backstop."""
        client = (client, "") if isinstance(client, str) else tuple(client)
        await self._turn(client)
        try:
            return await self._run(job)
        finally:
            self._release(client)

    async def _turn(self, client: Client) -> None:
        if self._free and not self._waiting:
            self._free -= 1
            self._give(client)
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(client, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:  # the request went away while waiting: its place, or its slot, is given on
            if turn.done() and not turn.cancelled():
                self._release(client)
            else:
                queue = self._waiting.get(client)
                if queue is not None and turn in queue:
                    queue.remove(turn)
                    if not queue:
                        del self._waiting[client]
            raise

    def _release(self, holder: Client) -> None:
        """``holder``'s slot freed: to the next client in turn (which then goes to the back of the line), or kept free."""
        for who in (holder, holder[0]):
            self._running[who] -= 1
            if not self._running[who]:
                del self._running[who]
        while self._waiting:
            client = min(self._waiting, key=self._order)
            queue = self._waiting[client]
            turn = queue.popleft()
            if not queue:
                del self._waiting[client]
            if not turn.done():
                self._give(client)
                turn.set_result(None)
                return
        self._free += 1

    def _order(self, client: Client) -> tuple[int, int, int, int]:
        """A waiting client's place: its address's jobs running and last turn, then its own."""
        address = client[0]
        return (self._running[address], self._served.get(address, -1), self._running[client],
                self._served.get(client, -1))

    def _give(self, client: Client) -> None:
        self._given += 1
        for who in (client, client[0]):
            self._running[who] += 1
            self._served.pop(who, None)
            self._served[who] = self._given
        while len(self._served) > 8192:  # clients long gone: forgotten, the oldest first
            del self._served[next(iter(self._served))]

    async def _run(self, job: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def work() -> None:
            try:
                outcome = (job(), None)
            except BaseException as exc:  # handed to the request, whatever it is (RecursionError, MemoryError ...)
                outcome = (None, exc)
            try:
                loop.call_soon_threadsafe(_settle, done, *outcome)
            except RuntimeError:  # the server stopped (its loop closed) while this ran: nobody waits for it
                pass

        threading.Thread(target=work, name="specdeploy-prompt", daemon=True).start()
        try:
            return await asyncio.wait_for(done, self.backstop)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            raise PromptTimeout(f"did not finish within {self.backstop:g} s of wall time") from None


def _settle(future: asyncio.Future, result, exc: BaseException | None) -> None:
    if future.done():  # timed out already
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
