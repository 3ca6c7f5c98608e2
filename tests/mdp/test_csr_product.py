"""The unchecked sparse products (mdp/csr_product.py, and mdp/factor.py's Operator) against scipy's own, bit for bit.

* ``matvec(A)(x)`` equals ``A @ x`` exactly for CSR and CSC matrices (32- and 64-bit indices,
  entries unsorted within rows included): the same compiled kernel, the terms in the same order;
* matrices it does not cover (another format, integer data), vectors of another shape and a
  private kernel that takes other arguments fall back to ``A @ x``;
* BiCGSTAB with an ``Operator`` for the matrix and its ILU preconditioner takes the same
  iterates as with the matrix and a plain ``LinearOperator``: the same answer to the last bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from overtake.mdp.csr_product import matvec
from overtake.mdp.factor import Operator


def _random(n: int, seed: int, fmt: str) -> sp.spmatrix:
    rng = np.random.default_rng(seed)
    A = sp.random(n, n, density=0.05, random_state=rng, format="coo") + sp.identity(n) * n
    return A.asformat(fmt)


@pytest.mark.parametrize("fmt", ["csr", "csc"])
@pytest.mark.parametrize("index", [np.int32, np.int64])
def test_matvec_is_scipy_product(fmt: str, index: type) -> None:
    A = _random(300, 1, fmt)
    A.indices, A.indptr = A.indices.astype(index), A.indptr.astype(index)
    x = np.random.default_rng(2).standard_normal(300)
    assert np.array_equal(matvec(A)(x), A @ x)


def test_matvec_unsorted_with_duplicates() -> None:
    rng = np.random.default_rng(3)
    rows, cols = rng.integers(0, 50, 400), rng.integers(0, 50, 400)
    A = sp.csr_matrix((rng.standard_normal(400), (rows, cols)), shape=(50, 50))
    # entries in reverse order within every row: both sum them in that stored order
    perm = np.concatenate([np.arange(A.indptr[i + 1] - 1, A.indptr[i] - 1, -1) for i in range(50)]).astype(np.int64)
    B = sp.csr_matrix((A.data[perm], A.indices[perm], A.indptr), shape=(50, 50))
    assert not B.has_sorted_indices or B.nnz < 2
    x = rng.standard_normal(50)
    assert np.array_equal(matvec(B)(x), B @ x)


def test_matvec_falls_back() -> None:
    A = _random(40, 4, "coo")
    x = np.arange(40.0)
    assert np.array_equal(matvec(A)(x), A @ x)
    Ai = sp.csr_matrix(np.arange(16).reshape(4, 4))
    assert np.array_equal(matvec(Ai)(np.arange(4.0)), Ai @ np.arange(4.0))
    C = _random(40, 5, "csr")
    X = np.ones((40, 2))
    assert np.array_equal(matvec(C)(X), C @ X)


@pytest.mark.parametrize("trans", [False, True])
def test_operator_bicgstab_same_iterates(trans: bool) -> None:
    A = _random(400, 6, "csc")
    op = A.T.tocsr() if trans else A
    ilu = spla.spilu(A, drop_tol=1e-2)
    t = "T" if trans else "N"
    b = np.random.default_rng(7).standard_normal(400)
    plain, info = spla.bicgstab(op, b, M=spla.LinearOperator(A.shape, lambda v: ilu.solve(v, trans=t)), rtol=1e-13,
                                atol=0.0)
    assert info == 0
    fast, info = spla.bicgstab(Operator(400, matvec(op)), b, M=Operator(400, lambda v: ilu.solve(v, trans=t)),
                               rtol=1e-13, atol=0.0)
    assert info == 0
    assert np.array_equal(plain, fast)
    assert np.linalg.norm(op @ fast - b) <= 1e-12 * np.linalg.norm(b)
    assert np.array_equal(Operator(400, matvec(op)) @ b, op @ b)  # through LinearOperator's own checks too


def test_matvec_falls_back_when_the_private_kernel_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scipy whose private kernel takes other arguments (the first direct call raises): the
    product is ``A @ x`` all the same, on that call and the next."""
    from scipy.sparse import _sparsetools

    A = _random(60, 8, "csr")
    x = np.random.default_rng(9).standard_normal(60)
    want, want2 = A @ x, A @ (2 * x)
    real = _sparsetools.csr_matvec
    refused = []

    def once_refused(*args: object) -> None:
        if not refused:  # the direct call comes first; scipy's own product (the fallback) after it
            refused.append(len(args))
            raise TypeError("csr_matvec() takes 8 arguments")
        real(*args)

    monkeypatch.setattr(_sparsetools, "csr_matvec", once_refused)
    prod = matvec(A)
    assert np.array_equal(prod(x), want)
    assert np.array_equal(prod(2 * x), want2)
    assert refused == [7]
