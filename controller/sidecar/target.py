"""The request-target as the sidecar forwards and routes it (RFC 3986 §6.2.2, RFC 9112 §3.2).

The routing path must be the one Apache routes on (its ``r->uri``): a target whose normal form
could differ between the two is refused (:class:`BadTarget`, a 400), as HAProxy does.
"""

from __future__ import annotations

from overtake.controller.errors import ControllerError

__all__ = ["BadTarget", "normalize_target"]

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_HEXDIGITS = frozenset(b"0123456789abcdefABCDEF")


class BadTarget(ControllerError, ValueError):
    """A request-target the sidecar refuses (400): its routing could differ from Apache's."""


def _normalize_path(path: bytes) -> tuple[bytes, str]:
    """(normalised path, decoded path) of an origin-form path (starts with ``/``)."""
    if b"%" not in path and b"//" not in path and b"/." not in path:  # the common case, on every request
        return path, path.decode("utf-8", "surrogateescape")
    out = bytearray()
    i, n = 0, len(path)
    escaped = False
    while i < n:
        c = path[i]
        if c != 0x25:  # %
            out.append(c)
            i += 1
            continue
        hx = path[i + 1:i + 3]
        if len(hx) != 2 or hx[0] not in _HEXDIGITS or hx[1] not in _HEXDIGITS:
            raise BadTarget(f"bad percent-escape {path[i:i + 3].decode('latin-1')!r} in the path")
        v = int(hx, 16)
        if v in _UNRESERVED:  # RFC 3986 §6.2.2.2: %73 is s
            out.append(v)
        elif v == 0x2F or v == 0:  # Apache refuses these itself (AllowEncodedSlashes Off; %00)
            raise BadTarget(f"encoded {'slash' if v else 'NUL'} %{hx.decode()} in the path")
        else:  # RFC 3986 §6.2.2.1: upper-case hex
            out += b"%" + hx.upper()
            escaped = True
        i += 3
    # merge duplicate slashes (Apache's MergeSlashes) and remove dot segments (RFC 3986 §5.2.4);
    # "." and ".." cannot hide in a remaining escape (%2E was decoded above)
    segs = bytes(out).split(b"/")[1:]
    stack: list[bytes] = []
    last = len(segs) - 1
    for k, seg in enumerate(segs):
        if seg == b".":
            if k == last:
                stack.append(b"")
        elif seg == b"..":
            if stack:
                stack.pop()
            if k == last:
                stack.append(b"")
        elif seg or k == last:
            stack.append(seg)
    norm = b"/" + b"/".join(stack)
    if escaped:  # what Apache's r->uri (and so its <Location> and handler maps) will be
        dec = bytearray()
        j = 0
        while j < len(norm):
            if norm[j] == 0x25:
                dec.append(int(norm[j + 1:j + 3], 16))
                j += 3
            else:
                dec.append(norm[j])
                j += 1
        return norm, bytes(dec).decode("utf-8", "surrogateescape")
    return norm, norm.decode("utf-8", "surrogateescape")


def normalize_target(url: bytes, method: bytes) -> tuple[bytes, str, bytes | None]:
    """The request-target as the sidecar forwards it, the path it routes on, and the authority of
    an absolute-form target (RFC 9112 §3.2.2: it replaces ``Host``).

    The path is normalised as RFC 3986 §6.2.2 says (percent-decoding of unreserved characters,
    upper-case hex in the other escapes, dot-segment removal, §5.2.4) and duplicate slashes are
    merged, as Apache does (``MergeSlashes``); the routing path is that, percent-decoded, which
    is Apache's ``r->uri``. So ``//stage1``, ``/./stage1``, ``/%73tage1`` and ``/x/../stage1``
    route, and reach Apache, as ``/stage1``. The query is kept as sent; a fragment is dropped
    (Apache drops it too).

    Raises
    ------
    BadTarget
        A malformed percent-escape, an encoded ``/`` or NUL, a scheme other than http(s), a
        userinfo, or a target in authority-form.
    """
    authority: bytes | None = None
    if url.startswith(b"/"):
        rest = url
    elif url == b"*" and method == b"OPTIONS":
        return url, "*", None
    else:
        scheme, sep, after = url.partition(b"://")
        if not sep or scheme.lower() not in (b"http", b"https"):
            raise BadTarget("request-target must be a path (/...) or an http:// URL")
        cut = min((p for p in (after.find(b"/"), after.find(b"?"), after.find(b"#")) if p >= 0), default=len(after))
        authority, rest = after[:cut], after[cut:]
        if not authority or b"@" in authority:
            raise BadTarget("absolute request-target needs a host and no userinfo")
        if not rest.startswith(b"/"):
            rest = b"/" + rest
    h = rest.find(b"#")
    if h >= 0:
        rest = rest[:h]
    q = rest.find(b"?")
    path, query = (rest, b"") if q < 0 else (rest[:q], rest[q:])
    norm, decoded = _normalize_path(path)
    return norm + query, decoded, authority

