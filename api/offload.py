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
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
        self._pool: ThreadPoolExecutor | None = None

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
        fut = asyncio.wrap_future(self._pool.submit(lambda: fn(*args, **kwargs)))
        try:
            # wait_for cancels the wrapped future, which cancels the pool's if it has not started
            return await asyncio.wait_for(fut, self.deadline)
        except TimeoutError:
            raise HTTPError(503, f"{what}: not done within the request deadline of {self.deadline:g} s "
                                 f"(overtake api --request-deadline); send a smaller request, or retry later",
                            {"Retry-After": "5"}) from None

    @staticmethod
    async def commit(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn`` off the loop without a deadline, for a step that must finish once begun."""
        return await run_in_threadpool(fn, *args, **kwargs)
