"""The Anderson mixer's compiled passes on a short iterate (mdp/anderson.py, ``compiled=True``).

* on a linear fixed point x = Gx + b (G a contraction) the compiled and numpy mixers take the same
  steps to rounding, and both reach the known answer (I − G)⁻¹ b from a dense solve;
* the default keeps numpy below ``KERNEL_MIN`` entries and the compiled passes from there on;
* Gauss–Seidel's law (which mixes compiled at any size) of a small random chain is the null
  vector of (I − P)ᵀ that a dense solve gives.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from overtake.mdp import _kernels  # noqa: F401  (the compiled passes: loaded as a large solve loads them)
from overtake.mdp.anderson import KERNEL_MIN, AndersonMixer
from overtake.mdp.evaluate import stationary_distribution


def _run(compiled: bool | None, G: np.ndarray, b: np.ndarray, steps: int) -> list[np.ndarray]:
    mixer = AndersonMixer(b.size, 5, compiled=compiled)
    x = np.zeros(b.size)
    out = []
    for _ in range(steps):
        x = mixer.step(x, G @ x + b - x)
        out.append(x.copy())
    return out


def test_compiled_and_numpy_mixers_agree_on_a_short_iterate() -> None:
    rng = np.random.default_rng(11)
    n = 60
    G = rng.random((n, n))
    G *= 0.9 / np.abs(np.linalg.eigvals(G)).max()
    b = rng.standard_normal(n)
    exact = np.linalg.solve(np.eye(n) - G, b)
    fast, slow = _run(True, G, b, 40), _run(False, G, b, 40)
    for a, c in zip(fast, slow, strict=True):
        assert np.allclose(a, c, rtol=1e-9, atol=1e-12 * np.abs(exact).max())
    for x in (fast[-1], slow[-1]):
        assert np.abs(x - exact).max() <= 1e-9 * np.abs(exact).max()


def test_default_path_by_size() -> None:
    assert not AndersonMixer(KERNEL_MIN - 1, 3).compiled
    assert AndersonMixer(KERNEL_MIN, 3).compiled
    assert AndersonMixer(10, 3, compiled=True).compiled


def test_gauss_seidel_law_of_a_small_chain_is_the_dense_null_vector() -> None:
    rng = np.random.default_rng(12)
    n = 400  # above the dense limit once the kernels are loaded: Gauss–Seidel
    P = rng.random((n, n)) * (rng.random((n, n)) < 0.02)
    P[np.arange(n), (np.arange(n) + 1) % n] += 1.0  # a cycle: irreducible
    P /= P.sum(axis=1, keepdims=True)
    reach, pi = stationary_distribution(sp.csr_matrix(P))
    assert reach.size == n
    M = (np.eye(n) - P).T
    M[0] = 1.0
    rhs = np.zeros(n)
    rhs[0] = 1.0
    dense = np.linalg.solve(M, rhs)
    assert np.abs(pi - dense).max() <= 1e-10 * dense.max()
