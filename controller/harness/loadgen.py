"""Open-loop transactions against the stage handler, replayed through the sidecar (van der Weij et al.'s tandem).

A trace holds Poisson arrivals (rate λ of the model) and, per stage, a service demand drawn from
the stage's PH distribution with its start phase (:func:`make_trace`). :func:`replay` sends each
transaction at its scheduled time, in model time units of ``unit`` seconds: GET
/stage1?work=d1 then, on the same connection once it completes, GET /stage2?work=d2, each with
the start phase in X-Overtake-Phase (and the next stage's in X-Overtake-Next-Phase). Response
times count from the *scheduled* arrival. :func:`calibrate` measures Apache's CPU per request
beyond the handler's burn, which the replay subtracts from every demand. :func:`batch_means`
and :func:`paired_gain_ci` summarise the response times (20 batch means, Student t with 19
degrees of freedom). Used by bench/apache_table2.py, bench/paired.py and the demo.
"""

from __future__ import annotations

import asyncio
import http.client
import secrets
import statistics
import subprocess
import time
import urllib.parse
from pathlib import Path

import numpy as np

from overtake.controller.harness.scratch import free_port
from overtake.mdp.model import TandemModel
from overtake.mdp.routes import RouteSplit

__all__ = [
    "T_975_19",
    "batch_means",
    "calibrate",
    "get",
    "http_request",
    "make_trace",
    "paired_gain_ci",
    "replay",
    "request",
    "route_path",
    "sample_ph",
    "sidecar_admin",
    "wait_idle",
    "wait_sidecar",
]

T_975_19 = 2.093  # Student t, 19 degrees of freedom (20 batch means)


def sample_ph(alpha: np.ndarray, T: np.ndarray, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n PH(α, T) samples by simulating the absorbing CTMC; returns (values, start phases 0-based)."""
    m = T.shape[0]
    rates = -np.diag(T)
    exit_p = np.concatenate([np.maximum(T - np.diag(np.diag(T)), 0), -T.sum(axis=1, keepdims=True)], axis=1)
    exit_p = exit_p / rates[:, None]
    start = rng.choice(m, size=n, p=alpha / alpha.sum())
    out = np.zeros(n)
    for i in range(n):
        j = start[i]
        t = 0.0
        while j < m:
            t += rng.exponential(1.0 / rates[j])
            j = rng.choice(m + 1, p=exit_p[j])
        out[i] = t
    return out, start


def make_trace(model: TandemModel, n: int, seed: int, routes: RouteSplit | None = None) -> dict[str, np.ndarray]:
    """``n`` Poisson transactions at the model's rate: arrivals, per stage a PH demand and its start phase.

    With ``routes`` (the multi-route workload) each stage entry also draws its route class
    ``route{i}`` by the routes' weights and the start phase from that route's prior, so the
    stage's demands are still PH(α_i, T_i) (Σ_r p_r α_r = α_i).
    """
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / model.arrival_rate, size=n))
    tr: dict[str, np.ndarray] = {"arrival": arrivals}
    for i, st in enumerate(model.stages):
        T = np.asarray(st.T, float)
        if routes is None:
            d, ph = sample_ph(np.asarray(st.alpha, float), T, n, rng)
        else:
            rs = routes.stages[i]
            r = rng.choice(len(rs), size=n, p=np.array([x.weight for x in rs]) / sum(x.weight for x in rs))
            d, ph = np.zeros(n), np.zeros(n, dtype=np.int64)
            for k, route in enumerate(rs):
                sel = np.flatnonzero(r == k)
                d[sel], ph[sel] = sample_ph(np.asarray(route.alpha, float), T, sel.size, rng)
            tr[f"route{i}"] = r.astype(np.int64)
        tr[f"demand{i}"] = d
        tr[f"phase{i}"] = ph
    return tr


def route_path(stage: int, trace: dict[str, np.ndarray], i: int) -> str:
    """The path transaction ``i`` asks for at ``stage`` (0-based): ``/stage<k>``, or with route
    classes in the trace ``/stage<k>/r<route>`` (the sidecar's learned mode keys history by it)."""
    routes = trace.get(f"route{stage}")
    return f"/stage{stage + 1}" if routes is None else f"/stage{stage + 1}/r{int(routes[i])}"


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str, phase: int | None,
               next_phase: int | None = None) -> int:
    nxt = "" if next_phase is None else f"X-Overtake-Next-Phase: {next_phase}\r\n"
    ph = "" if phase is None else f"X-Overtake-Phase: {phase}\r\n"
    writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\n{ph}{nxt}\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    n = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":", 1)[1])
    await reader.readexactly(n)
    return status


async def replay(port: int, trace: dict[str, np.ndarray], unit: float, n_stages: int,
                 overhead: float = 0.0, host: str = "127.0.0.1", phase_header: bool = True) -> tuple[np.ndarray, int]:
    """Open-loop replay; returns response times (s) from the *scheduled* arrival, and failures.
    ``phase_header`` False sends no X-Overtake-Phase/-Next-Phase: traffic as a real site has it."""
    loop = asyncio.get_running_loop()
    n = trace["arrival"].size
    out = np.full(n, np.nan)
    failures = 0
    t0 = loop.time() + 0.2

    async def one(i: int) -> None:
        nonlocal failures
        due = t0 + trace["arrival"][i] * unit
        await asyncio.sleep(max(0.0, due - loop.time()))
        try:
            reader, writer = await asyncio.open_connection(host, port)
            try:
                for s in range(n_stages):
                    work = max(trace[f"demand{s}"][i] * unit - overhead, 0.0)
                    nxt = int(trace[f"phase{s + 1}"][i]) + 1 if s + 1 < n_stages and phase_header else None
                    code = await _get(reader, writer, f"{route_path(s, trace, i)}?work={work:.6f}",
                                      int(trace[f"phase{s}"][i]) + 1 if phase_header else None, nxt)
                    if code != 200:
                        failures += 1
                        return
            finally:
                writer.close()
            out[i] = loop.time() - due
        except (OSError, asyncio.IncompleteReadError, ValueError):
            failures += 1

    await asyncio.gather(*(one(i) for i in range(n)))
    return out, failures


async def _makespan(port: int, n: int, work: float, host: str = "127.0.0.1") -> float:
    loop = asyncio.get_running_loop()

    async def one() -> None:
        r, w = await asyncio.open_connection(host, port)
        try:
            assert await _get(r, w, f"/stage1?work={work:.6f}", 1) == 200
        finally:
            w.close()

    t = loop.time()
    await asyncio.gather(*(one() for _ in range(n)))
    return loop.time() - t


def calibrate(port: int, unit: float, n: int = 40, rounds: int = 3, host: str = "127.0.0.1") -> float:
    """Apache's CPU per request beyond the stage handler's burn (s): n concurrent requests of one
    time unit each, direct to Apache (all share the core), overhead = makespan / n - unit; the
    median of ``rounds``. Subtracted from every demand so a request costs Apache d x unit in all."""
    asyncio.run(_makespan(port, n, 0.0, host))  # warm every worker thread's Lua state
    runs = [asyncio.run(_makespan(port, n, unit, host)) / n - unit for _ in range(rounds)]
    return max(0.0, float(statistics.median(runs)))


def batch_means(x: np.ndarray, batches: int = 20) -> tuple[float, float]:
    """Mean of ``x`` after a 5 % warm-up (NaN failures left out) and its 95 % half-width by batch means."""
    x = x[~np.isnan(x)]
    x = x[int(0.05 * x.size):]
    means = [float(b.mean()) for b in np.array_split(x, batches)]
    return float(np.mean(means)), T_975_19 * float(np.std(means, ddof=1)) / np.sqrt(batches)


def paired_gain_ci(star: np.ndarray, other: np.ndarray, batches: int = 20) -> float:
    """95 % half-width of the gain (E W(π) − E W(π*)) / E W(π*) from paired batch means.

    The policies replay the same trace, so per-transaction differences are strongly correlated
    and the gain is far better determined than either mean; the half-width is that of the mean
    difference over E W(π*) (the denominator's own error is second order at these sizes).
    """
    ok = ~(np.isnan(star) | np.isnan(other))
    warm = int(0.05 * int(ok.sum()))
    d = (other - star)[ok][warm:]
    means = [float(b.mean()) for b in np.array_split(d, batches)]
    base = float(np.mean(star[ok][warm:]))
    return float(T_975_19 * float(np.std(means, ddof=1)) / np.sqrt(batches) / base)


def request(method: str, port: int, path: str, *, body: bytes | None = None,
            headers: dict[str, str] | None = None, host: str = "127.0.0.1", timeout: float = 60.0,
            source: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection (no proxy, no redirects), from ``source`` if given.

    Returns the status, the response headers (lower-case names) and the body.
    """
    conn = http.client.HTTPConnection(host, port, timeout=timeout, source_address=(source, 0) if source else None)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def get(port: int, path: str, headers: dict[str, str] | None = None, *, host: str = "127.0.0.1",
        timeout: float = 60.0) -> tuple[int, bytes]:
    """:func:`request` ``GET``: the status and the body."""
    code, _, body = request("GET", port, path, headers=headers, host=host, timeout=timeout)
    return code, body


def http_request(method: str, url: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """:func:`request` by URL (``http://host:port/path?query``); the status and body, also for an
    HTTP error status."""
    u = urllib.parse.urlsplit(url)
    target = (u.path or "/") + (f"?{u.query}" if u.query else "")
    code, _, data = request(method, u.port or 80, target, body=body, headers=headers, host=u.hostname or "127.0.0.1",
                            timeout=30)
    return code, data


def sidecar_admin(token_file: Path) -> tuple[int, list[str], dict[str, str]]:
    """For a sidecar a bench starts: a free loopback port for its admin listener and a fresh token
    written to ``token_file``; (the port, the sidecar's flags, the header its ``PUT /-/policy`` sends)."""
    token = secrets.token_hex(16)
    path = token_file
    path.write_text(token + "\n")
    path.chmod(0o600)
    port = free_port()
    return (port, ["--admin-listen", f"127.0.0.1:{port}", "--admin-token-file", str(path)],
            {"Authorization": f"Bearer {token}"})


def wait_idle(admin: int, timeout: float = 120) -> None:
    """Wait until the sidecar whose admin listener is on ``admin`` has no request in flight
    (``overtake_inflight`` 0)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = http_request("GET", f"http://127.0.0.1:{admin}/metrics")[1].decode()
        line = next((ln for ln in text.splitlines() if ln.startswith("overtake_inflight ")), "overtake_inflight 1")
        if float(line.split()[1]) == 0:
            return
        time.sleep(0.2)


def wait_sidecar(port: int, proc: subprocess.Popen[bytes], log: Path, *, timeout: float = 60.0) -> None:
    """Wait until the sidecar started as ``proc`` answers ``/-/healthz`` on ``port`` (its public
    listener: ready, Apache reachable).

    Raises
    ------
    RuntimeError
        ``proc`` exited or ``timeout`` passed first; the message holds its log.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            if get(port, "/-/healthz", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the sidecar on port {port} did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.1)
