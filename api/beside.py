"""Work that does not need the solve's result, run on another core while the solve runs here.

``overtake solve --cpu-priority age`` needs the age thresholds and π(∞)'s E[W] with them, neither
of which depends on the policy being solved: on a machine with a second core they run there, in a
forked worker, so the command takes about the longer of the two instead of their sum. The solve
itself hands the worker parts that do not depend on each other the same way (the first policy's
evaluation ladder while the next cap is solved; the policy's overtaking rules while it is
simulated). On one core (or where the worker cannot start) the work runs here, when its result is
asked for; the answer is the same.

The worker is a fork of this process: it starts with this process's imports and data, so nothing
is copied to it; only its answer comes back, pickled through a pipe.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["Beside", "start"]

T = TypeVar("T")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _answer(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """``fn``'s value or its exception, pickled (an exception that does not pickle as its repr)."""
    try:
        return pickle.dumps((True, fn(*args, **kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
        try:
            return pickle.dumps((False, exc), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001
            return pickle.dumps((False, RuntimeError(f"worker: {exc!r}")), protocol=pickle.HIGHEST_PROTOCOL)


class Beside(Generic[T]):
    """``fn(*args, **kwargs)`` in a forked worker; :meth:`result` waits for it (or runs it here)."""

    def __init__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> None:
        self._call = (fn, args, kwargs)
        self._pid: int | None = None
        self._fd: int | None = None
        if _cores() < 2:
            return
        try:
            read, write = os.pipe()
        except OSError:
            return
        try:
            pid = os.fork()
        except OSError:
            os.close(read)
            os.close(write)
            return
        if pid == 0:  # the worker: answer, then leave without running the parent's exit handlers
            code = 0
            try:
                os.close(read)
                data = _answer(fn, args, kwargs)
                with os.fdopen(write, "wb") as fh:
                    fh.write(data)
            except BaseException:  # noqa: BLE001 - the parent sees no answer and runs the call itself
                code = 1
            finally:
                os._exit(code)
        os.close(write)
        self._pid, self._fd = pid, read

    def result(self) -> T:
        """The worker's answer (its exception re-raised), or the call run here without a worker."""
        fn, args, kwargs = self._call
        if self._fd is not None:
            with os.fdopen(self._fd, "rb") as fh:
                data = fh.read()
            self._fd = None
            self._reap()
            if data:
                try:
                    ok, value = pickle.loads(data)
                except Exception:  # noqa: BLE001 - a cut-off answer (the worker was killed): do it here
                    ok, value = None, None
                if ok is True:
                    out: T = value
                    return out
                if ok is False:
                    raise value
        return fn(*args, **kwargs)  # no worker, or it died (killed, out of memory): do it here

    def cancel(self) -> None:
        """Stop the worker, if any, without its answer."""
        if self._pid is not None:
            try:
                os.kill(self._pid, 9)
            except OSError:
                pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._reap()

    def _reap(self) -> None:
        if self._pid is not None:
            try:
                os.waitpid(self._pid, 0)
            except ChildProcessError:
                pass
            self._pid = None


def start(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Beside[T]:
    """Start ``fn(*args, **kwargs)`` beside this process (module docstring)."""
    return Beside(fn, *args, **kwargs)
