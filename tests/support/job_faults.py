"""Jobs that misbehave, injected into :class:`overtake.api.jobs.JobRunner` as its ``entry``.

They run in the solver processes, so they live in a module of their own (pickled by name; the
spawned processes inherit the test's ``sys.path``).
"""

from __future__ import annotations

import time

from overtake.api.db import Store


def runaway_if_named(db_url: str, job_id: str) -> str:
    """A job whose name has ``runaway`` starts and never ends; any other ends at once, done."""
    store = Store(db_url)
    job = store.get(job_id)
    assert job is not None
    if not store.start(job_id):
        return "skipped"
    if "runaway" in job.name:
        time.sleep(3600)
    store.finish(job_id, {"stages": {}})
    return "done"


def stall(db_url: str, job_id: str) -> str:
    """Never starts its job: every job handed out stays queued in the store."""
    time.sleep(3600)
    return "never"
