"""The set-up step compiles the solver kernels into numba's cache: a fresh process never compiles."""

from __future__ import annotations

import subprocess
import sys


def test_after_the_warm_up_a_fresh_process_loads_every_kernel_from_the_cache():
    # what the Makefile runs at set-up (a no-op apart from loading when the cache is current)
    subprocess.run([sys.executable, "-m", "overtake.mdp._warmup"], check=True, capture_output=True)
    code = "from overtake.mdp._warmup import kernel_cache_misses, warm_up; warm_up(); print(kernel_cache_misses())"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "0"


def test_the_ahead_of_time_kernels_equal_the_jit_ones_and_load_without_numba():
    """After the set-up step a solve runs the extension (no numba imported); its RVI, Anderson and
    Gauss–Seidel results equal the JIT kernels' bit for bit (the same source, _kernels_jit.py)."""
    subprocess.run([sys.executable, "-m", "overtake.mdp._warmup"], check=True, capture_output=True)
    code = """
import sys, numpy as np
from overtake.mdp import _kernels
from overtake.mdp._warmup import _model
from overtake.mdp.evaluate import stationary_distribution
from overtake.mdp.policy import _trim_longest
from overtake.mdp.average_cost import anderson_rvi, induced_matrix, relative_value_iteration
from overtake.mdp.statespace import StateSpace, Truncation

space = StateSpace(_model(), Truncation(9, 3))
runs = []
for aot in (True, False):
    _kernels.USE_AOT = aot
    a = anderson_rvi(space, tol=1e-8)
    r = relative_value_iteration(space, tol=1e-6)
    reach, pi = stationary_distribution(induced_matrix(space, a.decision))
    w = np.random.default_rng(0).integers(0, 6, size=(50, 3))
    runs.append((a.bias, a.decision, r.bias, pi, space.ranker.rank(space.rows), _trim_longest(w, w.sum(axis=1) // 2)))
    if aot:
        print("numba" in sys.modules, _kernels.aot_active())
print(all(np.array_equal(x, y) for x, y in zip(*runs)))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["False", "True", "True"]
