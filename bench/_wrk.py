"""One wrk run, pinned to a core, parsed: the load generator the HTTP overhead benches share."""

from __future__ import annotations

import re
import subprocess

_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def wrk(url: str, connections: int, duration: float, core: int) -> dict[str, float]:
    """Run ``wrk -t1 -cN -dDs --latency URL`` on ``core``.

    Returns
    -------
    dict
        ``p50_ms``, ``p99_ms``, ``rps``, ``non2xx`` and ``requests`` (completed in the run).
    """
    out = subprocess.run(
        ["taskset", "-c", str(core), "wrk", "-t1", f"-c{connections}", f"-d{duration:g}s", "--latency", url],
        capture_output=True, text=True, check=True,
    ).stdout
    res: dict[str, float] = {}
    for pct in ("50", "99"):
        m = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", out, re.MULTILINE)
        if m is None:
            raise RuntimeError(f"wrk: no {pct}th percentile in its output:\n{out}")
        res[f"p{pct}_ms"] = float(m.group(1)) * _UNIT[m.group(2)]
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    n = re.search(r"^\s+(\d+) requests in", out, re.MULTILINE)
    if m is None or n is None:
        raise RuntimeError(f"wrk: no request rate in its output:\n{out}")
    res["rps"] = float(m.group(1))
    res["requests"] = float(n.group(1))
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    res["non2xx"] = float(m.group(1)) if m else 0.0
    return res
