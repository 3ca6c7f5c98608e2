"""The API process's two caches: loaded policies (decisions are the hot path) and rendered PNGs."""

from __future__ import annotations

import asyncio
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

from overtake.mdp.errors import PolicyFileError
from overtake.mdp.policy import Policy

from . import plots
from .db import Store
from .errors import HTTPError
from .offload import DEFAULT_DEADLINE

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

V = TypeVar("V")


class LRU(Generic[V]):
    """At most ``size`` entries; the least recently used goes first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, V] = OrderedDict()
        self._lock = threading.Lock()  # filled from the request threads (overtake.api.offload) too

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def put(self, key: str, value: V) -> V:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return value

    def hit(self, key: str) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
        return value


class PolicyCache:
    """Policies of done model jobs, read from their stored artifact once and kept (32 by default)."""

    def __init__(self, store: Store, size: int = 32) -> None:
        self.store = store
        self._lru: LRU[Policy] = LRU(size)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._lru

    def get(self, job_id: str) -> Policy:
        """The job's policy; 409 when it has no artifact, 500 when the artifact cannot be read."""
        pol = self._lru.hit(job_id)
        if pol is not None:
            return pol
        blob = self.store.artifact(job_id)
        if blob is None:
            raise HTTPError(409, f"id: model {job_id!r} has no policy artifact")
        with tempfile.TemporaryDirectory(prefix="overtake-api-") as tmp:
            path = Path(tmp) / f"{job_id}.npz"
            path.write_bytes(blob)
            try:
                pol = Policy.load(path)
            except PolicyFileError as exc:
                raise HTTPError(500, f"policy: stored artifact unreadable: {exc}") from None
        return self._lru.put(job_id, pol)


class PlotCache:
    """PNGs by key (128 by default), drawn off the event loop on one thread, within the request deadline.

    One thread: matplotlib's font cache is not thread-safe. Off the loop: a decision must not wait
    for a figure. :meth:`start` and :meth:`close` follow the app's lifespan.
    """

    def __init__(self, size: int = 128, deadline: float = DEFAULT_DEADLINE) -> None:
        self._lru: LRU[bytes] = LRU(size)
        self._pool: ThreadPoolExecutor | None = None
        self.deadline = deadline

    def start(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="overtake-plot")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    async def png(self, key: str, build: Callable[[], Figure]) -> bytes:
        """The cached PNG under ``key``, or the figure ``build`` draws, rendered and cached."""
        blob = self._lru.hit(key)
        if blob is None:
            fut = asyncio.get_running_loop().run_in_executor(self._pool, lambda: plots.png(build()))
            try:
                fig_bytes = await asyncio.wait_for(fut, self.deadline)
            except TimeoutError:
                raise HTTPError(503, f"figure: not drawn within the request deadline of {self.deadline:g} s "
                                     f"(overtake api --request-deadline); retry later", {"Retry-After": "5"}) from None
            blob = self._lru.put(key, fig_bytes)
        return blob
