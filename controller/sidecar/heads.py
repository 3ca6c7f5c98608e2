"""The heads the sidecar writes: to Apache (:func:`upstream_head`), to the client
(:func:`client_head`), and its own plain-text answers (:func:`simple_response`).

Hop-by-hop headers (RFC 9110 §7.6.1, incl. those named in ``Connection``) are dropped in both
directions.
"""

from __future__ import annotations

from overtake.controller.sidecar.request import Request
from overtake.controller.sidecar.upstream import UpstreamResponse

__all__ = ["REASONS", "client_head", "simple_response", "upstream_head"]

_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
                  b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade"})
#: reason phrases of the statuses the sidecar writes itself
REASONS = {400: b"Bad Request", 403: b"Forbidden", 404: b"Not Found", 405: b"Method Not Allowed", 408: b"Request Timeout",
           413: b"Content Too Large", 431: b"Request Header Fields Too Large", 500: b"Internal Server Error",
           502: b"Bad Gateway", 503: b"Service Unavailable", 200: b"OK"}
#: x-overtake-gate: only the sidecar's own reaches Apache (a client's would hold a worker)
_SET_HERE = frozenset({b"content-length", b"expect", b"x-forwarded-host", b"x-overtake-gate"})


def simple_response(status: int, text: str, *, close: bool, extra: bytes = b"") -> bytes:
    """A whole plain-text response written by the sidecar itself."""
    body = (text + "\n").encode()
    return (b"HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n%s%s\r\n"
            % (status, REASONS.get(status, b"Error"), len(body), extra,
               b"Connection: close\r\n" if close else b"")) + body


def upstream_head(req: Request, peer: str, body_len: int, upstream_host: bytes, cpu_class: int | None = None,
                  upgrade: bytes | None = None, gate: bytes | None = None) -> bytes:
    """The request head sent to Apache: hop-by-hop headers dropped, ``X-Forwarded-For`` appended,
    ``X-Forwarded-Proto`` kept if the request has one (the gateway strips it from untrusted
    clients: a trusted front end that terminated TLS says ``https``), else ``http`` (the scheme
    the client used to reach the sidecar), ``X-Forwarded-Host`` (the client's ``Host``) set in
    place of any the client sent, ``Host``
    added if missing, the (de-chunked) body's ``Content-Length``; with ``cpu_class`` the sidecar's
    ``X-Overtake-Class`` (mod_overtake_prio's starting level) replaces the client's; ``gate`` is the
    ``X-Overtake-Gate`` value of a request sent while queued (:mod:`overtake.controller.sidecar.gate`); a
    client's own ``X-Overtake-Gate`` never passes."""
    drop = _drop_set(req.headers)
    if cpu_class is not None:
        drop = drop | {b"x-overtake-class"}
    out = [b"%s %s HTTP/1.1\r\n" % (req.method, req.target or req.url)]
    xff = None
    has_host = has_proto = False
    host = b""
    for k, v in req.headers:
        lk = k.lower()
        if lk in drop or lk in _SET_HERE:
            continue
        if lk == b"x-forwarded-for":
            xff = v if xff is None else xff + b", " + v
            continue
        if lk == b"host":
            has_host, host = True, v
        elif lk == b"x-forwarded-proto":
            has_proto = True
        out.append(k + b": " + v + b"\r\n")
    p = peer.encode()
    out.append(b"X-Forwarded-For: " + (xff + b", " + p if xff else p) + b"\r\n")
    if not has_proto:
        out.append(b"X-Forwarded-Proto: http\r\n")
    if host:
        out.append(b"X-Forwarded-Host: " + host + b"\r\n")
    if not has_host:
        out.append(b"Host: " + upstream_host + b"\r\n")
    if cpu_class is not None:
        out.append(b"X-Overtake-Class: %d\r\n" % cpu_class)
    if gate is not None:
        out.append(b"X-Overtake-Gate: " + gate + b"\r\n")
    if upgrade is not None:  # hop-by-hop: the sidecar asks Apache for the upgrade itself
        out.append(b"Connection: Upgrade\r\nUpgrade: %s\r\n" % upgrade)
    if body_len or req.method in (b"POST", b"PUT", b"PATCH"):
        out.append(b"Content-Length: %d\r\n" % body_len)
    out.append(b"\r\n")
    return b"".join(out)


def client_head(resp: UpstreamResponse, req: Request, body_len: int | None, chunked: bool) -> bytes:
    """The response head sent to the client: Apache's, hop-by-hop headers dropped, with
    ``Content-Length`` (``body_len``) or chunked framing and the client's keep-alive."""
    drop = _drop_set(resp.headers)
    out = [b"HTTP/1.1 %d %s\r\n" % (resp.status, resp.reason or REASONS.get(resp.status, b""))]
    for k, v in resp.headers:
        lk = k.lower()
        if lk in drop or (lk == b"content-length" and body_len is not None):
            continue
        out.append(k + b": " + v + b"\r\n")
    if body_len is not None and not (req.method == b"HEAD" or resp.status in (204, 304) or resp.status < 200):
        out.append(b"Content-Length: %d\r\n" % body_len)
    if chunked:
        out.append(b"Transfer-Encoding: chunked\r\n")
    if not req.keep_alive:
        out.append(b"Connection: close\r\n")
    elif req.version == "1.0":
        out.append(b"Connection: keep-alive\r\n")
    out.append(b"\r\n")
    return b"".join(out)


def _drop_set(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Hop-by-hop header names: the fixed list plus any named in Connection (RFC 9110 §7.6.1)."""
    extra = None
    for k, v in headers:
        if k.lower() == b"connection":
            for x in v.split(b","):
                t = x.strip().lower()
                if t not in (b"keep-alive", b"close"):
                    extra = (extra or set()) | {t}
    return _HOP if extra is None else _HOP | extra

