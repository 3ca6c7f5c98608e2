"""The fitting kernels' ahead-of-time extension: the same numbers as the JIT kernels, used only for
the argument types it was built for, and no numba in a fit that has it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from overtake.fitting import _kernels, fit
from overtake.fitting._her_start import initial
from overtake.fitting._hypererlang import her_em

needs_aot = pytest.mark.skipif(not _kernels.aot_active(), reason="no current _fitting_aot (make venv builds it)")


@pytest.fixture
def jit_only():
    use, _kernels.USE_AOT = _kernels.USE_AOT, False
    yield
    _kernels.USE_AOT = use


def _her_args():
    x = np.sort(np.random.default_rng(1).lognormal(0.0, 1.0, 300))
    shapes, pi, lam = initial(x, np.ones(x.size), (2, 1, 1))
    return x, np.ones(x.size), shapes, pi, lam, 50, 1e-9


@needs_aot
def test_the_extension_computes_what_the_jit_kernels_do():
    args = _her_args()
    a, b = [np.array(v, copy=True) if isinstance(v, np.ndarray) else v for v in args], list(_her_args())
    ta, na, ca = _kernels._aot.her_em(*a)
    tb, nb, cb = her_em(*b)
    assert na == nb and ca == cb
    assert np.allclose(ta, tb, rtol=1e-12) and np.allclose(a[3], b[3], rtol=1e-10) and np.allclose(a[4], b[4])


@needs_aot
def test_a_fit_through_the_extension_matches_the_jit_fit(jit_only):
    x = np.random.default_rng(7).lognormal(0.0, 1.0, 3000)
    jit = fit(x, order=4, random_state=0)
    _kernels.USE_AOT = True
    aot = fit(x, order=4, random_state=0)
    # the same EM; the extension is compiled without fastmath, so the last digits may differ
    assert aot.loglik == pytest.approx(jit.loglik, abs=0.05)


@needs_aot
def test_arrays_of_another_type_go_to_the_jit_kernel(monkeypatch):
    """The extension reads a float64 array passed for an int64 one as int64 (unboxing checks
    nothing): such calls must reach the JIT kernel, which compiles for what it is given."""
    called = []
    monkeypatch.setattr(_kernels, "_aot", type("Aot", (), {"her_em": staticmethod(lambda *a: called.append(a))})())
    x, w, shapes, pi, lam, it, tol = _her_args()
    assert _kernels._fits("her_em", (x, w, shapes, pi, lam, it, tol))
    assert not _kernels._fits("her_em", (x, w, shapes.astype(np.int64), pi, lam, it, tol))
    assert not _kernels._fits("her_em", (x[::2], w[::2], shapes, pi, lam, it, tol))
    assert not _kernels._fits("forward_chain", (pi, pi, pi, 1.0, np.ones((2, 2)), 1e-10, 32.0))
    trace, n, _ = _kernels.her_em(x[::2].copy(), w[::2].copy(), shapes.astype(np.int64), pi, lam, it, tol)
    assert called == [] and n >= 1 and np.isfinite(trace[-1])


@needs_aot
def test_a_fit_with_the_extension_imports_no_numba(tmp_path):
    probe = ("import sys, numpy as np\nfrom overtake.fitting import fit\n"
             "fit(np.random.default_rng(3).lognormal(0.0, 1.0, 500), order=3, random_state=0)\n"
             "print(sorted(m for m in ('numba', 'scipy.linalg') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().replace("'", '"')) == []
