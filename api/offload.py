"""A request's long work, off the event loop and under a deadline.

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
request bodies in separate (spawned, lower-priority) processes instead, which hand back only
what passed their checks: a scenario of bounded size, samples as arrays. A process, unlike a
thread, can be stopped: a body still being decoded at the deadline has its process terminated
and replaced, so it takes no process from the requests after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar, cast

from starlette.concurrency import run_in_threadpool

from .errors import HTTPError, WorkerDiedError, WorkerTimeoutError
from .worker import Worker

log = logging.getLogger("overtake.api")

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
        except TimeoutError:
            raise HTTPError(503, f"{what}: not done within the request deadline of {self.deadline:g} s "
                                 f"(overtake api --request-deadline); send a smaller request, or retry later",
                            {"Retry-After": "5"}) from None

    @staticmethod
    async def commit(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn`` off the loop without a deadline, for a step that must finish once begun."""
        return await run_in_threadpool(fn, *args, **kwargs)


def _parse_process_init(preload: Callable[[], object] | None) -> None:
    """In a parse process: yield the core to the API's event loop, then run ``preload`` (the
    caller's imports of the functions the process will run)."""
    os.nice(10)
    if preload is not None:
        preload()


#: parse processes: one upload running to its deadline holds one, the other keeps decoding
PARSE_PROCESSES = 2


class ParseProcess:
    """Request bodies decoded in spawned processes at nice +10 (:class:`~overtake.api.worker.Worker`),
    off the interpreter lock the event loop needs. ``fn`` and its arguments cross by pickle, so
    ``fn`` is a module-level function.

    A request takes an idle process, waiting at most ``deadline`` seconds for one, and its step
    gets what is left of the deadline. Past it the client gets a 503 and the process is
    terminated and replaced: a step that would run on (a hostile upload) costs one process for
    one deadline, never the others' requests. The deadline starts once a process is up (their
    imports take seconds on a loaded machine: no request's fault), and so after ``preload``, a
    module-level function each process runs first to import the modules of the functions it will
    be given (the API's routers: their imports are not part of any request's deadline).
    """

    def __init__(self, deadline: float = DEFAULT_DEADLINE, processes: int = PARSE_PROCESSES, *,
                 preload: Callable[[], object] | None = None) -> None:
        self.deadline = deadline
        self.processes = processes
        self.preload = preload
        self._lock = threading.Lock()
        self._workers: set[Worker] = set()
        self._closed = True
        self._started = 0  # processes that came up since start(): wait_ready counts them
        self._all_up = threading.Event()

    def start(self) -> None:
        """Spawn the processes (from the event loop's thread; they come up in the background)."""
        self._loop = asyncio.get_running_loop()
        self._idle: asyncio.Queue[Worker] = asyncio.Queue()
        self._up = asyncio.Event()
        # per process at most one step it runs and one replacement being spawned; one for the start
        self._threads = ThreadPoolExecutor(max_workers=2 * self.processes + 1, thread_name_prefix="overtake-parse")
        self._closed = False
        self._threads.submit(self._spawn_all)

    def _spawn_all(self) -> None:
        """The processes one after another: the first is up (and serving) sooner than if all
        imported at once on a busy machine."""
        for _ in range(self.processes):
            self._spawn()

    def wait_ready(self, timeout: float) -> None:
        """Block until every process has started and imported (tests: their pids are then known)."""
        if not self._all_up.wait(timeout):
            raise TimeoutError(f"the parse processes did not start within {timeout} s")

    def pids(self) -> list[int]:
        """The live processes' ids."""
        with self._lock:
            return sorted(w.pid for w in self._workers if w.pid is not None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers = list(self._workers)
            self._workers.clear()
        for w in workers:
            w.stop()  # a step still running gets WorkerDiedError; its thread closes its pipe
        while not self._idle.empty():
            self._idle.get_nowait().close()
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def run(self, what: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` in a parse process; 503 naming ``what`` and the limit past the
        deadline, or when the process died. Errors ``fn`` raises (an :class:`HTTPError` with
        its 4xx) reach the client unchanged."""
        if self._closed:
            raise HTTPError(503, "server: the parse process is not running (start the app with its lifespan)")
        await self._up.wait()
        t0 = self._loop.time()
        busy = HTTPError(503, f"{what}: every parse process was busy for the whole request deadline of "
                              f"{self.deadline:g} s (overtake api --request-deadline); retry later",
                         {"Retry-After": "5"})
        try:
            worker = await asyncio.wait_for(self._idle.get(), self.deadline)
        except TimeoutError:
            raise busy from None
        left = self.deadline - (self._loop.time() - t0)
        if left <= 0:  # the process came just too late: it goes back, unharmed
            self._release(worker)
            raise busy
        # the thread owns the process until the step ends: a client that hangs up meanwhile
        # cancels only this await, and the process still comes back (or is replaced)
        outcome, value = await self._loop.run_in_executor(self._threads, self._step, worker, fn, args, kwargs, left)
        if outcome == "ok":
            return cast(T, value)
        if outcome == "raised":
            raise value
        if outcome == "timeout":
            raise HTTPError(503, f"{what}: not done within the request deadline of {self.deadline:g} s "
                                 f"(overtake api --request-deadline); send a smaller request, or retry later",
                            {"Retry-After": "5"})
        raise HTTPError(503, f"{what}: the parse process ended while decoding this request ({value}); retry",
                        {"Retry-After": "1"})

    def _step(self, worker: Worker, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              timeout: float) -> tuple[str, Any]:
        """In a thread: the step, then the process back to the idle ones, or replaced."""
        try:
            value = worker.call(fn, args, kwargs, timeout)
        except WorkerTimeoutError:
            self._replace(worker)
            return "timeout", None
        except WorkerDiedError as exc:
            self._replace(worker)
            return "died", exc
        except Exception as exc:
            self._release(worker)
            return "raised", exc
        self._release(worker)
        return "ok", value

    def _spawn(self) -> None:
        """In a thread: a new process, handed to the idle ones once it has imported."""
        with self._lock:
            if self._closed:
                return
            worker = Worker(functools.partial(_parse_process_init, self.preload), name="overtake-parse")
            self._workers.add(worker)
        try:
            worker.wait_ready()
        except WorkerDiedError as exc:  # its imports failed: a broken install, not worth a loop of retries
            log.error("a parse process ended while starting (%s); requests wait for the others", exc)
            self._discard(worker)
            with contextlib.suppress(RuntimeError):  # (the loop is gone: the server stopped)
                self._loop.call_soon_threadsafe(self._up.set)  # requests then wait at most their deadline
            return
        with self._lock:
            self._started += 1
            if self._started >= self.processes:
                self._all_up.set()
        self._release(worker)

    def _release(self, worker: Worker) -> None:
        def put() -> None:
            if self._closed:
                worker.close()
                return
            self._idle.put_nowait(worker)
            self._up.set()
        try:
            self._loop.call_soon_threadsafe(put)
        except RuntimeError:  # the loop is gone: the server stopped
            worker.close()

    def _discard(self, worker: Worker) -> None:
        with self._lock:
            self._workers.discard(worker)
        worker.close()

    def _replace(self, worker: Worker) -> None:
        """Terminate an overrunning (or dead) process and start another in its place."""
        self._discard(worker)
        with self._lock:
            if not self._closed:
                self._threads.submit(self._spawn)
