"""Two-stage MediaWiki transactions: an open-loop Poisson trace and its replay over HTTP/1.1.

A transaction is what an editor does: *preview* (``POST /api.php?action=parse`` of the article's
wikitext) then, once the preview has arrived, *view* (``GET /wiki/Title``), both on one
connection. :func:`make_trace` draws Poisson arrivals at the rate that makes the CPU ``load``
given each article's idle service times (measured by :func:`measure_idle`), and the article of
every transaction uniformly. :func:`replay` sends each transaction at its scheduled time
(open loop: a slow server does not slow the arrivals) and returns every transaction's response
time, counted from the *scheduled* arrival to the view's last byte, and its outcome.

Every request carries ``X-Bench-Id: <tag>-<index>-<p|v>``, which the private Apache logs, so the
bench can join its access log with the transactions.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["OK", "Replayed", "Reply", "Transaction", "arrival_rate", "make_trace", "preview_body", "replay", "run_one",
           "serialisation_probe"]

OK = "ok"
PREVIEW_PATH = "/api.php?action=parse&format=json"


def arrival_rate(load: float, preview_s: np.ndarray, view_s: np.ndarray) -> float:
    """Transactions per second that keep one core busy a fraction ``load`` of the time when the
    article of each transaction is drawn uniformly: ``load / mean(preview + view)``."""
    if not 0 < load < 1:
        raise ValueError(f"load: the target CPU utilisation in (0, 1), got {load!r}")
    cost = float(np.mean(np.asarray(preview_s) + np.asarray(view_s)))
    if not cost > 0:
        raise ValueError(f"service times: the mean transaction cost must be > 0, got {cost!r}")
    return load / cost


def make_trace(n: int, rate: float, articles: int, seed: int) -> dict[str, np.ndarray]:
    """``n`` transactions: Poisson arrival times (s from the start) at ``rate`` per second and the
    article of each, uniform over ``articles``; the same ``seed`` gives the same trace."""
    if n < 1 or articles < 1 or not rate > 0:
        raise ValueError(f"trace: need n >= 1, articles >= 1 and rate > 0; got n={n}, articles={articles}, rate={rate}")
    rng = np.random.default_rng(seed)
    return {"arrival": np.cumsum(rng.exponential(1.0 / rate, size=n)),
            "article": rng.integers(0, articles, size=n)}


def preview_body(title: str, text: str) -> bytes:
    """The form body of a preview: MediaWiki's ``action=parse`` of unsaved wikitext."""
    return urllib.parse.urlencode({"title": title, "text": text, "contentmodel": "wikitext"}).encode()


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    close: bool  # the server will close the connection after it


async def _read_reply(reader: asyncio.StreamReader) -> Reply:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    hdr: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            hdr[k.strip().lower()] = v.strip()
    close = hdr.get("connection", "").lower() == "close"
    if "chunked" in hdr.get("transfer-encoding", "").lower():
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                    pass
                break
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        body = b"".join(parts)
    elif "content-length" in hdr:
        body = await reader.readexactly(int(hdr["content-length"]))
    else:
        body, close = await reader.read(), True
    return Reply(status, body, close)


async def _request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, method: str, target: str,
                   rid: str, body: bytes = b"") -> Reply:
    extra = (f"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {len(body)}\r\n"
             if method == "POST" else "")
    writer.write(f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Bench-Id: {rid}\r\n{extra}\r\n".encode() + body)
    await writer.drain()
    return await _read_reply(reader)


def _outcome(reply: Reply, stage: str) -> str | None:
    """None when the reply is a good one, else why not (``http_<code>``, ``api_error``)."""
    if not 200 <= reply.status < 300:
        return f"{stage}_http_{reply.status}"
    if stage == "preview" and not reply.body.startswith(b'{"parse"'):
        return "preview_api_error"  # MediaWiki's API answers its errors with 200
    return None


@dataclass(frozen=True)
class Transaction:
    """One transaction's requests: the article's title and its preview body."""

    title: str
    body: bytes


async def run_one(host: str, port: int, tx: Transaction, rid: str) -> tuple[str, float, float]:
    """Preview then view on one connection (a second one if the server closes the first);
    returns the outcome and the two requests' times in seconds (NaN where not reached)."""
    reader, writer = await asyncio.open_connection(host, port)
    t_preview = t_view = float("nan")
    try:
        t0 = time.perf_counter()
        r = await _request(reader, writer, "POST", PREVIEW_PATH, f"{rid}-p", tx.body)
        t_preview = time.perf_counter() - t0
        bad = _outcome(r, "preview")
        if bad:
            return bad, t_preview, t_view
        if r.close:
            writer.close()
            reader, writer = await asyncio.open_connection(host, port)
        t1 = time.perf_counter()
        r = await _request(reader, writer, "GET", f"/wiki/{tx.title}", f"{rid}-v")
        t_view = time.perf_counter() - t1
        return _outcome(r, "view") or OK, t_preview, t_view
    finally:
        writer.close()


async def _replay(host: str, port: int, trace: dict[str, np.ndarray], txs: Sequence[Transaction], tag: str,
                  timeout: float, first: int) -> Replayed:
    loop = asyncio.get_running_loop()
    n = trace["arrival"].size
    out = Replayed(np.full(n, np.nan), ["not_run"] * n, np.full((n, 2), np.nan))
    t0 = loop.time() + 0.2

    async def one(i: int) -> None:
        due = t0 + float(trace["arrival"][i])
        await asyncio.sleep(max(0.0, due - loop.time()))
        try:
            res, tp, tv = await asyncio.wait_for(run_one(host, port, txs[int(trace["article"][i])],
                                                         f"{tag}-{first + i}"), timeout)
            out.stages[i] = tp, tv
        except TimeoutError:
            res = "timeout"
        except (ConnectionError, asyncio.IncompleteReadError):
            res = "reset"
        except (OSError, ValueError) as exc:
            res = f"error_{type(exc).__name__}"
        out.outcomes[i] = res
        if res == OK:
            out.rt[i] = loop.time() - due

    await asyncio.gather(*(one(i) for i in range(n)))
    return out


@dataclass(frozen=True)
class Replayed:
    """A replay's result per transaction: the response time (s, NaN unless it succeeded), the
    outcome, and the client's time of the preview and of the view (s, columns 0 and 1; from the
    request's first byte sent to the reply's last byte received; NaN where not reached)."""

    rt: np.ndarray
    outcomes: list[str]
    stages: np.ndarray


def replay(port: int, trace: dict[str, np.ndarray], txs: Sequence[Transaction], *, tag: str,
           timeout: float = 120.0, host: str = "127.0.0.1", first: int = 0) -> Replayed:
    """Replay ``trace`` open-loop against ``host:port`` (:class:`Replayed`). Outcomes: ``ok``,
    ``<stage>_http_<code>``, ``preview_api_error``, ``reset``, ``timeout`` after ``timeout`` s,
    ``error_<Exception>``. Transaction ``i`` of ``trace`` sends the id ``<tag>-<first + i>``
    (a block of a longer trace keeps the whole trace's numbering)."""
    return asyncio.run(_replay(host, port, trace, txs, tag, timeout, first))


async def _burst(host: str, port: int, make: Sequence[tuple[str, str, bytes]]) -> list[float]:
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def one(method: str, target: str, body: bytes, k: int) -> float:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            r = await _request(reader, writer, method, target, f"probe-{k}", body)
            if not 200 <= r.status < 300:
                raise RuntimeError(f"serialisation probe: {method} {target} answered {r.status}")
            return loop.time() - t0
        finally:
            writer.close()

    return list(await asyncio.gather(*(one(m, t, b, k) for k, (m, t, b) in enumerate(make))))


def serialisation_probe(port: int, tx: Transaction, k: int = 4, rounds: int = 3,
                        host: str = "127.0.0.1") -> dict[str, float]:
    """``k`` identical requests sent at once, per stage: the mean completion time over the last.

    On one core, processor sharing finishes all ``k`` together (ratio near 1) while a lock that
    lets one run at a time finishes them one after another (ratio (k + 1) / 2k, 0.625 for k = 4).
    The median ratio of ``rounds`` bursts per stage.
    """
    out: dict[str, float] = {}
    reqs = {"preview": ("POST", PREVIEW_PATH, tx.body), "view": ("GET", f"/wiki/{tx.title}", b"")}
    for stage, req in reqs.items():
        ratios = []
        for _ in range(rounds):
            done = asyncio.run(_burst(host, port, [req] * k))
            ratios.append(float(np.mean(done) / np.max(done)))
        out[stage] = float(np.median(ratios))
    return out
