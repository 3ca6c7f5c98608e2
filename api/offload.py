"""A request's long work, off the event loop and under a deadline (issue 19).

One event loop answers every request, ``/healthz`` and the decision hot path included, so no
route does CPU work or a store read that decodes a large document on it: validating a scenario
and estimating its state space, checking inline samples, parsing an access log, reading jobs
(a fit's request holds its samples), loading a policy. :meth:`Offload.run` hands such a step to
a small thread pool and waits at most ``request_deadline`` seconds; past it the client gets a
503 naming the limit. A thread cannot be stopped, so a step over the deadline runs on, its
answer dropped; one still waiting for a thread is cancelled. The pool has two threads: steps
that overrun queue there and expire, without taking more of the machine than that.

Steps that must not answer 503 once begun, such as storing an accepted job, go through
:meth:`Offload.commit` (off the loop, no deadline): a 503 after the job was stored would make
the client post it twice.

A thread still shares the interpreter's lock: ``json.loads`` of a 16 MB body is one C call that
keeps it for about a second, and ``/healthz`` waited that long. :class:`ParseProcess` decodes
request bodies in a separate (spawned, lower-priority) process instead, which hands back only
what passed its checks: a scenario of bounded size, samples as arrays.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import ParamSpec, TypeVar

from starlette.concurrency import run_in_threadpool

from .errors import HTTPError

P = ParamSpec("P")
T = TypeVar("T")

#: seconds; ``overtake api --request-deadline``
DEFAULT_DEADLINE = 10.0


class Offload:
    """The pool of request steps; :meth:`start` and :meth:`close` follow the app's lifespan."""

    def __init__(self, deadline: float = DEFAULT_DEADLINE, threads: int = 2) -> None:
        self.deadline = deadline
        self.threads = threads
        self._pool: Executor | None = None

    def start(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="overtake-request")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def run(self, what: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` in the pool; 503 naming ``what`` and the limit past the deadline.

        Errors ``fn`` raises (an :class:`HTTPError` with its 4xx) reach the client unchanged.
        """
        if self._pool is None:
            raise HTTPError(503, "server: the request pool is not running (start the app with its lifespan)")
        try:
            fut = asyncio.wrap_future(self._pool.submit(fn, *args, **kwargs))
            # wait_for cancels the wrapped future, which cancels the pool's if it has not started
            return await asyncio.wait_for(fut, self.deadline)
        except BrokenProcessPool:
            self.close()  # the parse process died (killed for memory?): a fresh one for the next request
            self.start()
            raise HTTPError(503, f"{what}: the parse process ended while decoding this request; retry",
                            {"Retry-After": "1"}) from None
        except TimeoutError:
            raise HTTPError(503, f"{what}: not done within the request deadline of {self.deadline:g} s "
                                 f"(overtake api --request-deadline); send a smaller request, or retry later",
                            {"Retry-After": "5"}) from None

    @staticmethod
    async def commit(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn`` off the loop without a deadline, for a step that must finish once begun."""
        return await run_in_threadpool(fn, *args, **kwargs)


def _parse_process_init() -> None:
    """In the parse process: yield the core to the API's event loop, load the routes' parsers,
    and end with the server (killed, or gone while this process was busy with a body)."""
    os.nice(10)
    parent = os.getppid()

    def orphaned() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True, name="overtake-parse-watchdog").start()
    import overtake.api.routes.fits  # noqa: F401
    import overtake.api.routes.models  # noqa: F401


def _ready() -> bool:
    return True


class ParseProcess(Offload):
    """:class:`Offload` in one spawned process (no fork of a threaded server), at nice +10:
    body decoding that would otherwise hold the interpreter lock the event loop needs. ``fn``
    and its arguments cross by pickle, so ``fn`` is a module-level function."""

    def __init__(self, deadline: float = DEFAULT_DEADLINE) -> None:
        super().__init__(deadline, threads=1)

    def start(self) -> None:
        pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_parse_process_init)
        self._warm: Future[bool] = pool.submit(_ready)  # spawn and import now, not on the first request
        self._pool = pool

    def wait_ready(self, timeout: float) -> None:
        """Block until the process has started and imported (tests: its pid is then known)."""
        self._warm.result(timeout)

    async def run(self, what: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """As :meth:`Offload.run`; the deadline starts once the process is up (its imports take
        seconds on a loaded machine: no request's fault)."""
        if self._pool is not None and not self._warm.done():
            with contextlib.suppress(BrokenProcessPool):  # then the submit says so, and a new one starts
                await asyncio.wrap_future(self._warm)
        return await super().run(what, fn, *args, **kwargs)
