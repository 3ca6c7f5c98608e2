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


def test_the_ahead_of_time_simulator_equals_the_jit_one_and_loads_without_numba():
    """After the set-up step the simulator's event loop runs from its extension (no numba imported,
    the heuristic's decision included); on the same seeds every policy kind, with and without CPU
    priority levels, gives the JIT loop's results bit for bit (the same source, _simkernel.py)."""
    subprocess.run([sys.executable, "-m", "overtake.mdp._warmup"], check=True, capture_output=True)
    code = """
import sys, numpy as np
from overtake.mdp import _simcall
from overtake.mdp._warmup import _model
from overtake.mdp.heuristic import overtaking_heuristic
from overtake.mdp.priority import age_priority
from overtake.mdp.simulation import simulate
from overtake.mdp.solver import solve
from overtake.mdp.statespace import Truncation

model = _model()
pol = solve(model, truncation=Truncation(12, 4)).policy
age = age_priority(model, [1.5])
cases = [("pi(inf)", age), (pol, age), (pol, None), ("pi(2,1)", None), (overtaking_heuristic(model), age)]
runs = []
for aot in (True, False):
    _simcall.USE_AOT = aot
    runs.append([simulate(model, p, requests=20_000, seed=7, cpu_priority=pr) for p, pr in cases])
    if aot:
        print("numba" in sys.modules, _simcall.aot_active())
same = all(a.mean_response_time == b.mean_response_time and a.ci95 == b.ci95 and a.events == b.events
           and a.percentiles == b.percentiles and a.extra == b.extra for a, b in zip(*runs))
print(same, len({r.mean_response_time for r in runs[0]}) == len(cases))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["False", "True", "True", "True"]


def test_the_heuristics_decision_from_the_extension_equals_the_jit_one_and_loads_without_numba():
    """The heuristic's decision over a block of states comes from the simulator's extension (an
    observation-policy solve starts from the restricted heuristic: without it numba is imported for
    that alone); on random states of models with several phases, cores, an overhead, each variant
    and a thread cap it equals the JIT kernel's decision element for element, and the decisions are
    not all alike (the rows exercise the rule)."""
    subprocess.run([sys.executable, "-m", "overtake.mdp._warmup"], check=True, capture_output=True)
    code = """
import sys, numpy as np
from overtake.mdp import _simcall
from overtake.mdp._warmup import _model
from overtake.mdp.heuristic import overtaking_heuristic
from overtake.mdp.model import Stage, TandemModel

h2 = _model()
three = TandemModel(0.4, h2.stages + (Stage("s3", np.array([1.0]), np.array([[-2.0]])),), cores=2, overhead=0.05)
runs = []
for aot in (True, False):
    _simcall.USE_AOT = aot
    rng = np.random.default_rng(3)  # the same rows for both
    out = []
    for model in (h2, three):
        D = model.n_coords
        rows = np.concatenate([rng.integers(0, 5, size=(400, D)), rng.integers(0, 3, size=(400, D))], axis=1)
        for variant in ("pairwise", "lookahead", "literal"):
            h = overtaking_heuristic(model, variant=variant)
            out += [h.actions(rows), h.actions(rows, max_threads=4)]
    runs.append(out)
    if aot:
        print("numba" in sys.modules, _simcall.aot_active())
print(all(np.array_equal(a, b) for a, b in zip(*runs)), len({a.tobytes() for a in runs[0]}) > 4)
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["False", "True", "True", "True"]
