"""The sidecar's policy taken from the REST API (``overtake sidecar --policy-url URL``).

The API serves a solved model's artifact at ``GET /v1/models/{id}/policy.npz`` with the policy's
content hash as its ETag and answers ``304 Not Modified`` to an ``If-None-Match`` that matches, so
polling costs one small request while the policy is unchanged. :class:`PolicyFetcher` downloads
into a fresh temporary directory; the caller installs the file through the sidecar's atomic swap
(:meth:`overtake.controller.sidecar.service.Sidecar.swap`), which validates it first, so a truncated or foreign
download is refused and the running policy kept. Network and HTTP errors raise
:class:`PolicyFetchError`; they never touch the running policy.

The bearer token (``--policy-token``) goes only to the origin (scheme, host, port) of the
configured ``--policy-url``: a ``PUT /-/policy`` URL elsewhere is fetched without it, and a
redirect to another origin drops it (it is an unredirected header, re-added only when the
redirect stays on the token's origin), as curl and requests do. ``PUT /-/policy`` follows only
URLs that :func:`url_allowed` admits: the ``--policy-url`` origin and the ``admin_policy_urls``
prefixes; such a fetcher re-checks every redirect against the same rule (``allow``) and refuses
one that leaves it, before contacting it.

Where a URL is shown (``GET /-/policy``, log lines, errors) it goes through :func:`redact_url`:
credentials in its userinfo or query string never leave the process.

Fetch outcomes are counted in ``overtake_policy_fetches_total{result}`` with ``result`` one of
``updated`` (new policy installed), ``not_modified`` (304), ``error`` (API unreachable, non-2xx)
and ``refused`` (downloaded but not a valid policy for these stages).
"""

from __future__ import annotations

import re
import shutil
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from overtake.controller.errors import ControllerError, SidecarInputError

__all__ = ["FETCH_RESULTS", "Download", "PolicyFetchError", "PolicyFetcher", "fetch_counter", "normalize_policy_url",
           "origin", "redact_url", "url_allowed"]

FETCH_RESULTS = ("updated", "not_modified", "error", "refused")
_MODEL = re.compile(r"^(?P<base>.*/v1/models/(?P<id>[^/]+))(?:/policy(?:\.npz)?)?/?$")
_MAX_BYTES = 64 << 20  # policies.MAX_POLICY_BYTES (not imported: keep this module free of numpy)


class PolicyFetchError(ControllerError, RuntimeError):
    """The API could not be reached or did not answer 200/304; the message says which."""


def normalize_policy_url(url: str) -> str:
    """``http(s)://HOST:PORT/v1/models/ID[/policy[.npz]]`` -> the artifact URL ``.../ID/policy.npz``.

    Any other ``http(s)`` URL is taken as the artifact's address as is (a proxy, a file server).
    """
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise SidecarInputError(
            f"policy-url: expected http://HOST:PORT/v1/models/ID/policy.npz (from `overtake api`), got {url!r}"
        )
    m = _MODEL.match(parts.path)
    path = f"{m['base']}/policy.npz" if m else parts.path
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL, the port made explicit (RFC 6454 §4)."""
    parts = urllib.parse.urlsplit(url.strip())
    scheme = parts.scheme.lower()
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        port = -1
    return scheme, (parts.hostname or "").lower(), port


def redact_url(url: str) -> str:
    """``url`` as it may be shown: userinfo and query string replaced by ``REDACTED`` (either
    may carry a credential, e.g. ``?token=...``); anything that is not a URL is returned as is."""
    parts = urllib.parse.urlsplit(url)
    if not parts.scheme or not parts.netloc:
        return url
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "REDACTED@" + netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "REDACTED" if parts.query else "", ""))


def url_allowed(url: str, allow: Sequence[str], policy_url: str | None) -> bool:
    """May ``PUT /-/policy`` follow ``url``? Yes on the origin of ``policy_url`` and under any
    ``allow`` prefix (same origin, path below the prefix's path)."""
    o = origin(url)
    if o[0] not in ("http", "https") or not o[1]:
        return False
    if policy_url and o == origin(policy_url):
        return True
    path = urllib.parse.urlsplit(url.strip()).path or "/"
    for prefix in allow:
        if o != origin(prefix):
            continue
        base = urllib.parse.urlsplit(prefix.strip()).path or "/"
        if path == base or path.startswith(base if base.endswith("/") else base + "/"):
            return True
    return False


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Re-adds the token to a redirect only when it stays on the token's origin; with the
    fetcher's ``allow``, refuses a redirect to a URL it does not admit."""

    def __init__(self, fetcher: PolicyFetcher) -> None:
        self.fetcher = fetcher

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> urllib.request.Request | None:
        allow = self.fetcher.allow
        if allow is not None and not allow(newurl):
            fp.close()
            raise PolicyFetchError(
                f"GET {self.fetcher.shown}: redirected ({code}) to {redact_url(newurl)}, which is not on the "
                "policy_url origin nor under admin_policy_urls; not followed (add its prefix to admin_policy_urls)")
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            new.remove_header("Authorization")
            self.fetcher._authorize(new)
        return new


def fetch_counter(registry: CollectorRegistry) -> Counter:
    """``overtake_policy_fetches_total{result}`` registered on the sidecar's registry, all results at 0."""
    c = Counter("overtake_policy_fetches", "Policy downloads from --policy-url, by result",
                ["result"], registry=registry)
    for r in FETCH_RESULTS:
        c.labels(r)
    return c


@dataclass(frozen=True)
class Download:
    """A downloaded artifact in its own temporary directory (``cleanup()`` removes it)."""

    path: Path
    etag: str | None

    def cleanup(self) -> None:
        shutil.rmtree(self.path.parent, ignore_errors=True)


class PolicyFetcher:
    """Conditional GET of one artifact URL; blocking (run it in a thread from the event loop)."""

    def __init__(self, url: str, *, token: str | None = None, token_origin: str | None = None,
                 timeout: float = 10.0, max_bytes: int = _MAX_BYTES,
                 allow: Callable[[str], bool] | None = None) -> None:
        self.url = normalize_policy_url(url)
        #: the URL as shown in errors and ``GET /-/policy`` (no userinfo, no query)
        self.shown = redact_url(self.url)
        #: every redirect target must pass this (None: any redirect is followed)
        self.allow = allow
        self.token = token
        #: the token goes only here (default: this URL's own origin, i.e. ``--policy-url``)
        self.token_origin = origin(token_origin if token_origin is not None else self.url)
        self.timeout = timeout
        self.max_bytes = max_bytes
        self._opener = urllib.request.build_opener(_Redirects(self))
        tail = urllib.parse.urlsplit(self.url).path.rstrip("/")
        m = _MODEL.match(tail)
        # the file name becomes the policy's name in /-/policy and overtake_policy_info
        self.filename = f"policy-{m['id']}.npz" if m else (Path(tail).name or "policy.npz")

    def _authorize(self, req: urllib.request.Request) -> None:
        """The token as an unredirected header, on the token's origin only."""
        if self.token and origin(req.full_url) == self.token_origin:
            req.add_unredirected_header("Authorization", f"Bearer {self.token}")

    def fetch(self, etag: str | None) -> Download | None:
        """The artifact, or ``None`` when the server answers 304 for ``etag``.

        Raises
        ------
        PolicyFetchError
            Connection refused/timeout, or any status other than 200 and 304.
        """
        req = urllib.request.Request(self.url, headers={"Accept": "application/octet-stream"})
        if etag:
            req.add_header("If-None-Match", etag)
        self._authorize(req)
        try:
            with self._opener.open(req, timeout=self.timeout) as r:
                body = r.read(self.max_bytes + 1)
                new_etag = r.headers.get("ETag")
        except urllib.error.HTTPError as exc:
            if exc.code == 304:
                return None
            detail = exc.read(300).decode("utf-8", errors="replace").strip()
            raise PolicyFetchError(f"GET {self.shown}: HTTP {exc.code} {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise PolicyFetchError(f"GET {self.shown}: {reason}") from None
        if len(body) > self.max_bytes:
            raise PolicyFetchError(f"GET {self.shown}: body larger than policy_max_bytes = {self.max_bytes}")
        tmp = Path(tempfile.mkdtemp(prefix="overtake-policy-url-"))
        path = tmp / self.filename
        path.write_bytes(body)
        return Download(path, new_etag)
