"""The online loop's worker: the one process that runs refit jobs, and the policy files they write.

A refit job runs in its own process (spawned, not forked: the sidecar runs an event loop and
threads), at nice 19 (:func:`~overtake.controller.online.refit.lower_priority`), so that the event
loop never blocks on a fit or a solve. Each job writes its policy to a file of its own; only the
policy in force is kept.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from overtake.controller.online.refit import RefitJob, lower_priority, warm_up

__all__ = ["RefitWorker", "discard"]


class RefitWorker:
    """Runs ``job`` on :class:`RefitJob` s in ``executor`` (None: a one-process pool of its own,
    started on first use, restarted after it broke) and names their output files under
    ``policy_dir`` (None: a temporary directory, removed at :meth:`close`)."""

    def __init__(self, policy_dir: str | None, executor: Executor | None,
                 job: Callable[[RefitJob], dict[str, Any]]) -> None:
        self.executor = executor
        self._own_executor = executor is None
        self.job = job
        self.dir = Path(policy_dir) if policy_dir else None
        self._own_dir = self.dir is None
        self._seq = 0

    def pool(self) -> Executor:
        if self.executor is None:
            # spawn: no fork of a process running an event loop and threads; the worker runs at nice 19
            self.executor = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=lower_priority)
        return self.executor

    def warm(self) -> None:
        """Start the worker process and its imports ahead of the first refit."""
        self.pool().submit(warm_up)

    async def run(self, job: RefitJob) -> dict[str, Any]:
        """Run ``job`` in the worker; on failure its output file is removed and the error raised
        (a broken pool of its own is dropped, so that the next refit starts a new one)."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool(), self.job, job)
        except Exception as exc:
            if self._own_executor and self.executor is not None and type(exc).__name__ == "BrokenProcessPool":
                self.executor.shutdown(wait=False, cancel_futures=True)
                self.executor = None
            discard(job.out)
            raise

    def out_path(self) -> str:
        """A new file for the next job's policy."""
        if self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix="overtake-online-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        return str(self.dir / f"online-{os.getpid()}-{self._seq:04d}.npz")

    def prune(self, keep: str) -> None:
        """Delete earlier online policies (only the running one is needed)."""
        if self.dir is None:
            return
        for p in self.dir.glob(f"online-{os.getpid()}-*.npz"):
            if str(p) != keep:
                discard(str(p))

    def close(self) -> None:
        if self.executor is not None and self._own_executor:
            self.executor.shutdown(wait=False, cancel_futures=True)
            self.executor = None
        if self._own_dir and self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


def discard(path: str) -> None:
    """Remove a policy file that will not be used (gone already is fine)."""
    try:
        os.unlink(path)
    except OSError:
        pass
