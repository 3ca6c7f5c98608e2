"""Open-loop CPU-stage transactions through the sidecar, run in the client namespace.

Replays a Table 2 trace (overtake.controller.harness.loadgen: Poisson arrivals, PH demands and
start phases)
against ``--server``: each transaction is GET /stage1?work=d1 then /stage2?work=d2 on one
connection, the phase in X-Overtake-Phase. Writes the per-transaction response times (s, NaN
for a failure) as JSON. With ``--calibrate`` it instead prints Apache's CPU per request beyond
the burn, measured through a passthrough sidecar (``loadgen.calibrate``)::

    python bench/uplink/txclient.py --server 10.213.1.1:8080 --trace T.json --unit 0.01 \\
        --overhead 0.0003 --out R.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import numpy as np

from overtake.controller.harness.loadgen import calibrate, replay


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True, help="HOST:PORT of the sidecar")
    ap.add_argument("--trace", help="JSON trace: arrival, demand0, phase0, demand1, phase1 (model units)")
    ap.add_argument("--unit", type=float, default=0.01, help="seconds of CPU per model time unit")
    ap.add_argument("--overhead", type=float, default=0.0, help="seconds subtracted from every burn")
    ap.add_argument("--out", help="response times JSON")
    ap.add_argument("--calibrate", action="store_true")
    a = ap.parse_args()
    host, port = a.server.rsplit(":", 1)
    if a.calibrate:
        print(calibrate(int(port), a.unit, host=host))
        return 0
    tr = {k: np.asarray(v) for k, v in json.loads(Path(a.trace).read_text()).items()}
    n_stages = sum(1 for k in tr if k.startswith("demand"))
    rt, failures = asyncio.run(replay(int(port), tr, a.unit, n_stages, a.overhead, host=host))
    Path(a.out).write_text(json.dumps({"response_times": [None if np.isnan(x) else float(x) for x in rt],
                                       "failures": failures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
