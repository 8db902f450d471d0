"""One page of the job list, newest first: the listing orchestrator.api serves, importable without the pipelines
(the MCP server's stdio front answers resources/list with it before its SDK and the pipelines have loaded)."""

import base64
import json

from common.settings import Settings
from orchestrator import pool
from orchestrator.jobs import JobError, JobStore, Run


def page(limit: int, cursor: str | None, settings: Settings) -> tuple[list[Run], str | None]:
    """One page of runs, newest first, and the cursor of the next page (None at the end)."""
    before = None
    if cursor:
        try:
            created, run_id = json.loads(base64.urlsafe_b64decode(cursor.encode()))
            before = (float(created), str(run_id))
        except (ValueError, TypeError):
            raise JobError(f"cursor {cursor!r} is not one list_jobs gave out; start again without a cursor") from None
    store = JobStore(settings.jobs_db)
    pool.settle(store, settings)  # a listing moves the queue on, also when every worker died
    runs = pool.placed(store.page(limit + 1, before), store)
    if len(runs) <= limit:
        return runs, None
    last = runs[limit - 1]
    return runs[:limit], base64.urlsafe_b64encode(json.dumps([last.created, last.id]).encode()).decode()
