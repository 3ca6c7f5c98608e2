"""One spawned process that runs one call at a time and can be stopped in the middle of one.

A :class:`~concurrent.futures.ProcessPoolExecutor` has no public way to stop a single call:
killing one of its processes breaks the whole pool, and every other call in it fails. The API
needs exactly that stop: a request body whose parsing overruns the request deadline, a job past
its deadline or a cancelled job must end at once without taking the others down. So each of the
API's processes is a :class:`Worker` of its own, owned by one caller at a time, and a call that
must end has its process terminated; the owner starts a fresh one.

The process is spawned (no fork of a threaded server), runs ``initializer`` (imports, priority),
says it is ready, then answers calls sent over a pipe until the pipe closes. It exits on its own
when the server that started it is gone (killed, or stopped while this process was busy).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from .errors import WorkerDiedError, WorkerTimeoutError

log = logging.getLogger("overtake.api")

_READY = "ready"


def _exit_with_parent() -> None:
    """End this process once its parent is gone, even in the middle of a call."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="overtake-worker-watchdog").start()


def _serve(conn: Connection, initializer: Callable[[], object] | None) -> None:
    """The process's main loop: (fn, args, kwargs) in, (True, result) or (False, exception) out."""
    _exit_with_parent()
    if initializer is not None:
        initializer()
    conn.send(_READY)
    while True:
        try:
            fn, args, kwargs = conn.recv()
        except EOFError:  # the owner closed the pipe: done
            return
        try:
            reply: tuple[bool, Any] = (True, fn(*args, **kwargs))
        except Exception as exc:  # the caller's to handle, as a pool's future would re-raise it
            reply = (False, exc)
        try:
            data = bytes(ForkingPickler.dumps(reply))
        except Exception as exc:  # an answer that cannot cross back must not look like a crash
            data = bytes(ForkingPickler.dumps((False, RuntimeError(
                f"the worker's answer could not be sent back ({type(exc).__name__}: {exc})"))))
        conn.send_bytes(data)


def how_it_ended(exitcode: int | None) -> str:
    """``exit code N`` or ``killed by signal SIGKILL``, for a failure reason."""
    if exitcode is None:
        return "ended without an exit status"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class Worker:
    """A spawned process answering one call at a time (see the module docstring).

    One thread at a time may :meth:`call`; :meth:`stop` may come from any thread (it terminates
    the process, so a pending :meth:`call` raises :class:`WorkerDiedError`). :meth:`close` belongs to
    the owner, once no call is pending.
    """

    def __init__(self, initializer: Callable[[], object] | None = None, *, name: str = "overtake-worker") -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, initializer), name=name)
        self.process.start()
        child.close()  # the child's end lives in the child only: its exit is our EOF

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def _died(self) -> WorkerDiedError:
        self.process.join(5)  # the pipe closes a moment before the process is reaped
        return WorkerDiedError(how_it_ended(self.process.exitcode))

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the process has run its initializer; WorkerTimeoutError or WorkerDiedError otherwise."""
        try:
            if not self._conn.poll(timeout):
                raise WorkerTimeoutError(f"not ready within {timeout} s")
            if self._conn.recv() != _READY:
                raise WorkerDiedError("answered before it was ready")
        except (EOFError, OSError):
            raise self._died() from None

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             timeout: float | None) -> Any:
        """``fn(*args, **kwargs)`` in the process; what it raises is raised here.

        :class:`WorkerTimeoutError` after ``timeout`` seconds without an answer (the process still
        runs it: stop it), :class:`WorkerDiedError` when the process ended first.
        """
        try:
            self._conn.send((fn, args, kwargs))
            if not self._conn.poll(timeout):
                raise WorkerTimeoutError(f"no answer within {timeout} s")
            ok, value = self._conn.recv()
        except (EOFError, OSError):  # BrokenPipeError on send, EOF on recv: the process is gone
            raise self._died() from None
        if ok:
            return value
        raise value

    def stop(self) -> None:
        """Terminate the process and reap it (SIGKILL if SIGTERM did not end it); idempotent."""
        try:
            if self.process.exitcode is not None:
                return
            self.process.terminate()
            self.process.join(5)
            if self.process.exitcode is None:
                self.process.kill()
                self.process.join(5)
        except ValueError:  # closed by its owner meanwhile: already reaped
            pass

    def close(self) -> None:
        """Stop the process and release the pipe and the process handle."""
        self.stop()
        self._conn.close()
        try:
            self.process.close()
        except ValueError:  # still running after SIGKILL and 5 s: leave the handle to the GC
            log.warning("worker process %s did not end after SIGKILL", self.process.pid)
