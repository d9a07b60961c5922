"""Prompts are made off the event loop: chat templates are the artifact's code and tokenizing megabytes takes
time, and while either runs on the loop no other client (not even /health) is answered.

Each job runs in a daemon thread of its own (a thread cannot be stopped, and a pool's threads are joined at
exit: a template that never ends would hold the process), at most ``workers`` at once, each waited for at most
``seconds``; past that the request is answered and the thread is left to end on its own.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class PromptTimeout(TimeoutError):
    """A job that did not finish in time."""


class PromptWorkers:
    def __init__(self, seconds: float = 10.0, workers: int = 4):
        self.seconds = seconds
        self._slots: asyncio.Semaphore | None = None  # made on the loop that first uses it
        self.workers = workers

    async def run(self, job: Callable[[], T]) -> T:
        """``job()``'s result, computed in a thread; its exception re-raised here; ``PromptTimeout`` past ``seconds``."""
        loop = asyncio.get_running_loop()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        async with self._slots:
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
                return await asyncio.wait_for(done, self.seconds)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                raise PromptTimeout(f"did not finish within {self.seconds:g} s") from None


def _settle(future: asyncio.Future, result, exc: BaseException | None) -> None:
    if future.done():  # timed out already
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
