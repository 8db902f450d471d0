"""A cancel requested for a run stops its work at once: the task is cancelled, which closes its HTTP requests
(the LLM server aborts them) and makes the ComfyUI client drop or interrupt its prompt by id."""

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from orchestrator.jobs import JobStore

T = TypeVar("T")
POLL = 0.5  # seconds between looks at the run's cancel flag


class Cancelled(Exception):
    pass


async def unless_cancelled(store: JobStore, run_id: str, work: Awaitable[T], poll: float = POLL) -> T:
    """The result of `work`, or Cancelled as soon as (within `poll` seconds) a cancel is requested for the run."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                return task.result()
            if await asyncio.to_thread(store.cancel_requested, run_id):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task  # its cleanup (closing requests, cancelling the ComfyUI prompt) runs to the end
                raise Cancelled()
    finally:
        if not task.done():  # we were cancelled ourselves: take the work down with us
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
