"""Start-up of `overtake compare` on a small scenario (issue 21, part 2): what it must not import.

A fresh process pays for every module it loads; numba (0.3-0.5 s) and scipy's sparse solvers
(0.2 s) serve only large models. Checked in a child process so this suite's imports do not count.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CASE1 = Path(__file__).resolve().parents[2] / "examples" / "table1" / "case01.yaml"

PROBE = """
import contextlib, io, json, sys
from overtake.api.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main(["compare", sys.argv[1], "--json", "--quiet"])
doc = json.loads(out.getvalue())
heavy = [m for m in ("numba", "scipy.sparse.linalg", "scipy.sparse.csgraph") if m in sys.modules]
print(json.dumps({"code": code, "states": doc["states"], "heavy": heavy}))
"""


def test_small_compare_imports_neither_numba_nor_scipy_solvers():
    proc = subprocess.run([sys.executable, "-c", PROBE, str(CASE1)], capture_output=True, text=True, check=True)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["code"] == 0 and res["states"] < 5_000  # below bellman.KERNEL_MIN_STATES: numpy passes
    assert res["heavy"] == []
