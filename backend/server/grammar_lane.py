"""Schemas compile one at a time, in the order they come, off the event loop. A compile that runs past its limit is
refused, but a compile cannot be stopped: it goes on in its own thread (its grammar is kept, so the same schema sent
again starts at once) and gives the lane to the next schema, so a one-property schema never waits behind schemas
already refused. At most OVERRUNS such compiles go on at once; past that, the next waits for one of them to end."""

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

OVERRUNS = 2  # refused compiles still running beside the lane's; each takes a core while it lasts

_lane = threading.Semaphore(1)
_pool = ThreadPoolExecutor(max_workers=1 + OVERRUNS, thread_name_prefix="grammar")


class _Turn:
    """One compile's hold on the lane, given back once: when the compile ends or when its limit passes."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held = False

    def take(self) -> None:
        _lane.acquire()
        with self._lock:
            self._held = True

    def give_back(self) -> None:
        with self._lock:
            if self._held:
                self._held = False
                _lane.release()


async def compile_in_turn(compile_schema: Callable[[], object], limit: float):
    """compile_schema()'s result; TimeoutError when it runs past limit seconds counted from its start (not from when
    it joined the queue)."""
    loop, began, turn = asyncio.get_running_loop(), asyncio.Event(), _Turn()

    def job():
        turn.take()
        loop.call_soon_threadsafe(began.set)
        try:
            return compile_schema()
        finally:
            turn.give_back()

    compiling = loop.run_in_executor(_pool, job)
    # Read when it ends: after a timeout nobody awaits it, and an error left unread is logged as a fault.
    compiling.add_done_callback(lambda done: done.cancelled() or done.exception())
    queued = asyncio.ensure_future(began.wait())
    try:
        await asyncio.wait({compiling, queued}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        queued.cancel()
    try:
        return await asyncio.wait_for(asyncio.shield(compiling), limit)
    except TimeoutError:
        turn.give_back()
        raise
