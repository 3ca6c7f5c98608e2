"""Work that does not need the solve's result, run on another core while the solve runs here.

``overtake solve --cpu-priority age`` needs the age thresholds and π(∞)'s E[W] with them, neither
of which depends on the policy being solved: on a machine with a second core they run there, in a
forked worker, so the command takes about the longer of the two instead of their sum. On one core
(or where the worker cannot start) the work runs here, after the solve; the answer is the same.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["Beside", "start"]

T = TypeVar("T")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Beside(Generic[T]):
    """``fn(*args, **kwargs)`` in a forked worker; :meth:`result` waits for it (or runs it here)."""

    def __init__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> None:
        self._call = (fn, args, kwargs)
        self._pool: Any = None
        self._future: Any = None
        if _cores() < 2:
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        try:
            # fork: the worker starts with this process's imports, at no start-up cost of its own
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("fork"))
            self._future = self._pool.submit(fn, *args, **kwargs)
        except (OSError, ValueError):
            self._close()

    def result(self) -> T:
        """The worker's answer (its exception re-raised), or the call run here without a worker."""
        from concurrent.futures.process import BrokenProcessPool

        fn, args, kwargs = self._call
        if self._future is not None:
            try:
                value: T = self._future.result()
                return value
            except BrokenProcessPool:  # the worker died (killed, out of memory): do it here
                pass
            finally:
                self._close()
        return fn(*args, **kwargs)

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = self._future = None


def start(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Beside[T]:
    """Start ``fn(*args, **kwargs)`` beside this process (module docstring)."""
    return Beside(fn, *args, **kwargs)
