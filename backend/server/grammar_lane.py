"""Schema compiles run off the event loop, at most LANES at once, in the order they come, below the server's CPU
priority. A compile that runs past its limit (counted from its start, not from its wait for a lane) is refused,
but a compile cannot be stopped: it goes on in its thread and keeps its lane until it ends, and its grammar is kept,
so the same schema sent again starts at once. A one-property schema sent beside two slow ones finds a lane free and
compiles beside them; with one lane it waited 60 s behind their two refusals (bench/interactive_load.py)."""

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

LANES = 3  # compiles at once, refused ones still running included; past that the next waits for one to end
# Compiles run niced: beside a new request's prefill they would otherwise take the cores it needs (a quiet 2-core run
# measured its first token at 3.9 s beside two compiles, 0.1 s niced). xgrammar starts its compile threads from the
# calling thread, so they inherit it.
COMPILE_NICENESS = 15

_pool = ThreadPoolExecutor(max_workers=LANES, thread_name_prefix="grammar")  # its queue is the wait for a lane


async def compile_in_turn(compile_schema: Callable[[], object], limit: float):
    """compile_schema()'s result; TimeoutError when it runs past limit seconds counted from its start (not from when
    it joined the queue)."""
    loop, began = asyncio.get_running_loop(), asyncio.Event()

    def job():
        _lower_priority()
        loop.call_soon_threadsafe(began.set)
        return compile_schema()

    compiling = loop.run_in_executor(_pool, job)
    # Read when it ends: after a timeout nobody awaits it, and an error left unread is logged as a fault.
    compiling.add_done_callback(lambda done: done.cancelled() or done.exception())
    queued = asyncio.ensure_future(began.wait())
    try:
        await asyncio.wait({compiling, queued}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        queued.cancel()
    return await asyncio.wait_for(asyncio.shield(compiling), limit)


def _lower_priority() -> None:
    """This thread (and those it starts) at COMPILE_NICENESS, unless it already runs lower."""
    if not hasattr(os, "setpriority"):
        return
    me = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, me) < COMPILE_NICENESS:
            os.setpriority(os.PRIO_PROCESS, me, COMPILE_NICENESS)
    except OSError:  # a sandbox that forbids it: compiles keep the server's priority
        pass
