"""Where the sidecar's policy comes from, and following it: the policy file or the REST API.

:class:`PolicySource` loads the first policy before the sidecar listens, then follows its source:
the ``--policy`` file is re-read when its mtime or size changes (polled every ``watch_interval``
seconds; ``SIGHUP`` forces a reload through :meth:`PolicySource.reload`), and with ``--policy-url``
the API's artifact is polled every ``policy_poll`` seconds with its ETag
(:mod:`overtake.controller.sidecar.policy_fetch`); ``PUT /-/policy`` with an ``http://`` URL follows
another model. Every new policy goes through the sidecar's one
atomic swap (``install``, :meth:`overtake.controller.sidecar.service.Sidecar.install`), which validates
it off the event loop first: a refused or unreachable policy leaves the running one in place, and
the watcher logs it and keeps watching (whatever the file holds). The bearer token goes only to
the ``--policy-url`` origin (:mod:`overtake.controller.sidecar.policy_fetch`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter

from overtake.controller.errors import PolicyLoadError, SidecarInputError
from overtake.controller.sidecar.policies import SpawnPolicy, load_policy
from overtake.controller.sidecar.policy_fetch import (
    FETCH_RESULTS,
    PolicyFetcher,
    PolicyFetchError,
    fetch_counter,
    redact_url,
    url_allowed,
)
from overtake.controller.sidecar.policy_loads import LoadBusy
from overtake.controller.sidecar.stages import StageTable

if TYPE_CHECKING:
    from overtake.controller.sidecar.options import SidecarOptions

__all__ = ["PolicySource"]

log = logging.getLogger("overtake.sidecar")


class PolicySource:
    """The running policy's origin (a file, a spec such as ``pi(2)``, or an API URL) and its followers.

    Parameters
    ----------
    table
        The stages; a policy must match them.
    options
        ``policy``, ``policy_url``, ``policy_poll``, ``policy_token`` and ``watch_interval`` are read.
    install
        ``await install(spec, source)`` loads (off the event loop) and swaps in a policy, raising
        :class:`~overtake.controller.errors.PolicyLoadError` or
        :class:`~overtake.controller.errors.SidecarInputError` when it refuses it.
    current
        The running policy (named in log lines).
    """

    def __init__(self, table: StageTable, options: SidecarOptions,
                 install: Callable[[str, str], Awaitable[SpawnPolicy]], current: Callable[[], SpawnPolicy]) -> None:
        self.table = table
        self.options = options
        self.install = install
        self.current = current
        self.fetcher: PolicyFetcher | None = None
        self.etag: str | None = None
        self.fetch_error: str | None = None
        self.fetch_counts = dict.fromkeys(FETCH_RESULTS, 0)
        self.fetches: Counter | None = None
        self._fetch_lock = asyncio.Lock()
        fetched = self._initial_fetch() if options.policy.url else None
        #: the policy to start with
        self.first = fetched if fetched is not None else load_policy(
            options.policy.spec, table.names, max_bytes=options.policy.max_bytes,
            max_array_bytes=options.policy.max_array_bytes,
            max_inflated_bytes=options.policy.max_inflated_bytes)
        #: the file, spec or URL the running policy came from
        self.path = self.fetcher.url if fetched is not None and self.fetcher else options.policy.spec
        self._file_sig = self._signature()
        self._watch: asyncio.Task[None] | None = None
        self._poll: asyncio.Task[None] | None = None

    def register(self, registry: CollectorRegistry) -> None:
        """``overtake_policy_fetches_total{result}`` on ``registry``, counting the fetches so far."""
        self.fetches = fetch_counter(registry)
        for result, n in self.fetch_counts.items():
            self.fetches.labels(result).inc(n)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Watch the file and poll the URL (with ``--policy-url``)."""
        self._watch = asyncio.create_task(self._watch_file())
        if self.options.policy.url:
            self._poll = asyncio.create_task(self._poll_policy())

    async def reload(self, source: str, options: SidecarOptions | None = None) -> None:
        """``SIGHUP``: take new ``options`` (a reloaded config), then re-read the policy file, or
        poll the followed URL now. Failures are logged; the running policy stays."""
        if options is not None:
            old = self.options
            self.options = options
            if options.policy.spec and options.policy.spec != old.policy.spec:
                self.path = options.policy.spec
                self.unfollow()
            if options.policy.url and options.policy.url != old.policy.url:
                self.fetcher = self._new_fetcher(options.policy.url)
                self.etag = None
                if self._poll is None:
                    self._poll = asyncio.create_task(self._poll_policy())
        if self.fetcher is not None:
            try:
                await self.refresh(source)
            except (PolicyFetchError, PolicyLoadError, SidecarInputError):
                pass  # counted and logged
            return
        self._file_sig = self._signature()
        await self._reload(source)

    def url_allowed(self, url: str) -> bool:
        """May ``PUT /-/policy`` follow ``url`` (the policy URL's origin, ``admin_policy_urls``)?"""
        return url_allowed(url, self.options.guards.admin_policy_urls, self.options.policy.url)

    def _new_fetcher(self, url: str, *, checked: bool = False) -> PolicyFetcher:
        """A fetcher of ``url``; ``checked``: a URL given to ``PUT /-/policy``, whose redirects
        must stay where :meth:`url_allowed` admits (the configured ``policy_url`` is the
        operator's own choice and may redirect anywhere)."""
        opts = self.options
        # the token belongs to --policy-url's origin; without one it goes nowhere
        return PolicyFetcher(url, token=opts.policy.token, token_origin=opts.policy.url or "",
                             max_bytes=opts.policy.max_bytes, allow=self.url_allowed if checked else None)

    def stop(self) -> None:
        for task in (self._watch, self._poll):
            if task is not None:
                task.cancel()

    def info(self) -> dict[str, Any]:
        """The source fields of ``GET /-/policy``."""
        return {"source": redact_url(self.path), "policy_url": self.fetcher.shown if self.fetcher else None,
                "etag": self.etag, "fetches": dict(self.fetch_counts), "fetch_error": self.fetch_error}

    # ---- the policy file -------------------------------------------------------------------
    def _signature(self) -> tuple[float, int] | None:
        try:
            st = Path(self.path).stat()
        except OSError:
            return None
        return (st.st_mtime, st.st_size)

    async def _reload(self, source: str) -> None:
        if Path(self.path).exists() or source == "sighup":
            try:
                await self.install(self.path, source)
            except LoadBusy:
                self._file_sig = None  # not read at all: the watcher tries again at its next check
            except (PolicyLoadError, SidecarInputError):
                pass  # logged and counted by install; the old policy stays

    async def _watch_file(self) -> None:
        while True:
            await asyncio.sleep(self.options.policy.watch_interval)
            try:
                sig = self._signature()
                if sig is not None and sig != self._file_sig:
                    self._file_sig = sig
                    await self._reload("file_watch")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the watcher must outlive any one bad file
                log.error("policy file watch failed, still watching", extra={
                    "event": "policy_watch_error", "detail": f"{exc.__class__.__name__}: {exc}"})

    # ---- the REST API (--policy-url) -------------------------------------------------------
    def _count(self, result: str) -> None:
        self.fetch_counts[result] += 1
        if self.fetches is not None:
            self.fetches.labels(result).inc()

    def _initial_fetch(self) -> SpawnPolicy | None:
        """First download (blocking, before listening). Without a fallback ``--policy`` a failure is fatal."""
        opts = self.options
        assert opts.policy.url
        if not opts.policy.poll > 0:
            raise SidecarInputError(f"policy-poll: must be > 0 seconds, got {opts.policy.poll}")
        self.fetcher = self._new_fetcher(opts.policy.url)
        try:
            dl = self.fetcher.fetch(None)
            if dl is None:
                raise PolicyFetchError(f"GET {self.fetcher.shown}: 304 without If-None-Match")
        except PolicyFetchError as exc:
            self._count("error")
            self.fetch_error = str(exc)
            if not opts.policy.spec:
                raise SidecarInputError(f"policy-url: {exc}; start the API, fix the URL or give --policy as a fallback") from None
            log.warning("policy URL unreachable, using --policy", extra={"event": "policy_fetch_error", "detail": str(exc)})
            return None
        try:
            pol = load_policy(str(dl.path), self.table.names, max_bytes=opts.policy.max_bytes,
                              max_array_bytes=opts.policy.max_array_bytes,
                              max_inflated_bytes=opts.policy.max_inflated_bytes)
        except PolicyLoadError as exc:
            self._count("refused")
            self.fetch_error = f"refused: {exc}"
            if not opts.policy.spec:
                raise PolicyLoadError(f"policy-url: {self.fetcher.shown} did not give a usable policy ({exc})") from None
            return None
        finally:
            dl.cleanup()
        self._count("updated")
        self.etag = dl.etag
        return pol

    async def refresh(self, source: str) -> bool:
        """One conditional GET of the policy URL; True when a new policy was installed.

        Raises :class:`PolicyFetchError` (API down, HTTP error) or :class:`PolicyLoadError` (bad
        download); the running policy is kept in both cases.
        """
        async with self._fetch_lock:
            fetcher = self.fetcher
            if fetcher is None:
                return False
            try:
                dl = await asyncio.to_thread(fetcher.fetch, self.etag)
            except PolicyFetchError as exc:
                self._count("error")
                self.fetch_error = str(exc)
                log.warning("policy fetch failed, old policy kept", extra={
                    "event": "policy_fetch_error", "source": source, "detail": str(exc),
                    "policy": self.current().name})
                raise
            if dl is None:
                self._count("not_modified")
                self.fetch_error = None
                return False
            try:
                await self.install(str(dl.path), source)
            except (PolicyLoadError, SidecarInputError) as exc:
                self._count("refused")
                self.fetch_error = f"refused: {exc}"
                raise
            finally:
                dl.cleanup()
            self._count("updated")
            self.etag = dl.etag
            self.fetch_error = None
            self.path = fetcher.url
            return True

    async def _poll_policy(self) -> None:
        while True:
            await asyncio.sleep(self.options.policy.poll)
            try:
                await self.refresh("policy_poll")
            except (PolicyFetchError, PolicyLoadError, SidecarInputError):
                pass  # counted and logged; retry at the next poll

    async def follow(self, url: str) -> None:
        """Fetch ``url`` now and, if it installs, poll it from then on; on any error keep
        following the previous source and raise."""
        new = self._new_fetcher(url, checked=True)
        old_fetcher, old_etag = self.fetcher, self.etag
        self.fetcher, self.etag = new, None
        try:
            await self.refresh("admin_url")
        except (PolicyFetchError, PolicyLoadError, SidecarInputError):
            self.fetcher, self.etag = old_fetcher, old_etag
            raise
        if self._poll is None:
            self._poll = asyncio.create_task(self._poll_policy())

    def unfollow(self) -> None:
        """An explicit policy replaced the API's: stop following ``--policy-url``."""
        self.fetcher, self.etag, self.fetch_error = None, None, None
