"""One parsed client request and the rules its head must meet (RFC 9112) before the sidecar
reads its body or forwards it.

:func:`head_error` refuses a head RFC 9112 makes an error; :func:`upgrade_offer` and
:func:`body_framing` say whether llhttp stops at the head and how the body is framed;
:class:`Refusal` ends a connection with the status the gateway answers.
"""

from __future__ import annotations

from overtake.controller.errors import ControllerError

__all__ = ["Refusal", "Request", "body_framing", "content_length", "head_error", "upgrade_offer"]


class Request:
    """One parsed client request.

    ``url`` is the target as sent; ``target`` the normalised one forwarded to Apache and ``path``
    the decoded path routing sees (:func:`~overtake.controller.sidecar.target.normalize_target`);
    ``bad_target`` says why the target was refused (400), if it was.
    """

    __slots__ = ("bad_target", "body", "expect", "headers", "held", "keep_alive", "method", "path", "resume_body",
                 "target", "upgrade", "url", "version")

    def __init__(self) -> None:
        self.method = b""
        self.url = b""
        self.target = b""
        self.path = ""
        self.bad_target: str | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.keep_alive = True
        self.version = "1.1"
        self.expect = False
        #: ``b"websocket"`` for a WebSocket upgrade (RFC 6455 §4.1): admitted as a request of its
        #: route, then answered as a tunnel
        self.upgrade: bytes | None = None
        #: an ``h2c`` offer with a body: the framing header of the body, which llhttp leaves
        #: unread at the upgrade point and a fresh parser reads for this request
        #: (:meth:`~overtake.controller.sidecar.http1.ClientConnection._feed`)
        self.resume_body: bytes | None = None
        #: bytes of the body budget this request holds (its declared length, or what it received)
        self.held = 0


class Refusal(ControllerError):
    """A request refused from what was parsed so far: the connection answers ``status`` and ends."""

    def __init__(self, status: int, reason: str = "", message: str = "") -> None:
        self.status = status
        self.reason = reason
        self.message = message


def head_error(r: Request) -> str | None:
    """Why a parsed request head is refused (400), or None: RFC 9112 §2.3 (the sidecar speaks
    HTTP/1.0 and 1.1; llhttp also accepts 0.9 and 2.0 request lines), §3.2 (exactly one ``Host``
    in HTTP/1.1, at most one in 1.0) and §6.1 (``Transfer-Encoding`` in HTTP/1.0 is faulty
    framing, and a request's codings must end in ``chunked``: the sidecar takes exactly that one,
    as llhttp does, whose own check an ``Upgrade`` offer ends the head before). Forwarded, each
    would reach Apache framed or routed otherwise than here."""
    if r.version not in ("1.0", "1.1"):
        return f"HTTP/{r.version} request line: the sidecar speaks HTTP/1.1 (and 1.0)"
    hosts = 0
    codings: list[bytes] = []
    for k, v in r.headers:
        lk = k.lower()
        if lk == b"host":
            hosts += 1
        elif lk == b"transfer-encoding" and r.version == "1.0":
            return "Transfer-Encoding in an HTTP/1.0 request is faulty framing (RFC 9112 §6.1); send Content-Length"
        elif lk == b"transfer-encoding":
            codings += [c.strip(b" \t").lower() for c in v.split(b",")]
    if codings and codings != [b"chunked"]:
        return (f"Transfer-Encoding {b', '.join(codings).decode('latin-1')!r}: the sidecar takes a request body "
                "chunked or with Content-Length, nothing else (RFC 9112 §6.1)")
    if hosts > 1:
        return "more than one Host header field (RFC 9112 §3.2)"
    if hosts == 0 and r.version == "1.1":
        return "an HTTP/1.1 request needs a Host header field (RFC 9112 §3.2)"
    return None


def upgrade_offer(headers: list[tuple[bytes, bytes]]) -> set[bytes] | None:
    """The protocols (lower case, no version) of an ``Upgrade`` that ``Connection`` names, which
    is what makes llhttp stop at the end of the head; None without one."""
    offer: bytes | None = None
    named = False
    for k, v in headers:
        lk = k.lower()
        if lk == b"upgrade":
            offer = v
        elif lk == b"connection":
            named = named or any(t.strip().lower() == b"upgrade" for t in v.split(b","))
    if offer is None or not named:
        return None
    return {p.strip().split(b"/")[0].lower() for p in offer.split(b",")}


def body_framing(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The framing header of a request body (``Content-Length: N`` with N > 0, or a chunked
    ``Transfer-Encoding``), or None for a request without a body."""
    for k, _ in headers:
        if k.lower() == b"transfer-encoding":
            return b"Transfer-Encoding: chunked"  # llhttp refuses any other final coding
    n = content_length(headers)
    return b"Content-Length: %d" % n if n else None



def content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The ``Content-Length`` header's value; None if absent or not a number."""
    for k, v in headers:
        if k.lower() == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None
