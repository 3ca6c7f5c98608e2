"""Structures of a phase-type fit and the EM's M-step.

A structure is the zero pattern of ``T`` (edges ``src -> dst`` and which phases may exit); the
M-step of the Asmussen–Nerman–Olsson EM keeps that pattern, so CF1 (bidiagonal, ascending
rates, Cumani 1982) and Coxian fits stay in their structure. CF1 rates are re-sorted after each
M-step by the swap rule of :func:`overtake.fitting.families.sort_cf1`; hyper-Erlang branches keep
one rate per branch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ._estep import Sparse, Stats
from .families import sort_cf1
from .phase_type import PhaseType

__all__ = ["MAX_POISSON_TERMS", "Pattern", "mstep", "pack", "pattern", "rescale", "to_ph", "to_sparse", "unpack",
           "valid"]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Pattern:
    """Zero pattern of a structure and its M-step."""

    name: str
    src: npt.NDArray[np.int64]
    dst: npt.NDArray[np.int64]
    has_exit: npt.NDArray[np.bool_]
    branches: tuple[tuple[int, ...], ...] = ()  # tied-rate groups (hyper-Erlang)
    free_alpha: bool = True


def pattern(structure: str, p: int, shapes: tuple[int, ...] | None = None) -> Pattern:
    idx = np.arange(p)
    if structure in ("cf1", "coxian"):
        ex = np.zeros(p, dtype=bool) if structure == "cf1" else np.ones(p, dtype=bool)
        ex[-1] = True
        return Pattern(structure, idx[:-1].copy(), idx[1:].copy(), ex, free_alpha=structure == "cf1")
    if structure == "general":
        src, dst = np.nonzero(~np.eye(p, dtype=bool))
        return Pattern(structure, src.astype(np.int64), dst.astype(np.int64), np.ones(p, dtype=bool))
    assert shapes is not None
    src_l, dst_l, ex = [], [], np.zeros(p, dtype=bool)
    branches = []
    start = 0
    for k in shapes:
        ph = tuple(range(start, start + k))
        branches.append(ph)
        src_l += list(ph[:-1])
        dst_l += list(ph[1:])
        ex[ph[-1]] = True
        start += k
    return Pattern(structure, np.array(src_l, dtype=np.int64), np.array(dst_l, dtype=np.int64), ex,
                    branches=tuple(branches))


def to_sparse(ph: PhaseType, pat: Pattern) -> Sparse:
    T = ph.T
    rate = T[pat.src, pat.dst].astype(np.float64)
    exitv = np.where(pat.has_exit, ph.exit_rates, 0.0)
    diag = -(np.asarray(np.bincount(pat.src, weights=rate, minlength=ph.order), dtype=np.float64) + exitv)
    return Sparse(ph.alpha.astype(np.float64).copy(), diag, pat.src, pat.dst, rate, exitv)


def to_ph(s: Sparse, pat: Pattern) -> PhaseType:
    label = {"hyperexp": "hyperexponential"}.get(pat.name, pat.name)
    return PhaseType(s.alpha, s.dense(), structure=label)


def mstep(st: Stats, s: Sparse, pat: Pattern) -> Sparse:
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return mstep_raw(st, s, pat)


def mstep_raw(st: Stats, s: Sparse, pat: Pattern) -> Sparse:
    Z = np.where(st.Z > 1e-300, st.Z, 1e-300)
    alpha = st.B / st.B.sum() if pat.free_alpha else s.alpha
    rate = st.N / Z[pat.src]
    exitv = np.where(pat.has_exit, st.E / Z, 0.0)
    if pat.branches:
        rate = rate.copy()
        exitv = exitv.copy()
        for br in pat.branches:
            b = np.array(br)
            flows = st.E[b[-1]] + st.N[np.isin(pat.src, b)].sum()
            lam = flows / Z[b].sum()
            rate[np.isin(pat.src, b)] = lam
            exitv[b[-1]] = lam
    return _assemble(pat, alpha, rate, exitv)


def _assemble(pat: Pattern, alpha: FloatArray, rate: FloatArray, exitv: FloatArray) -> Sparse:
    """The sparse generator from edge and exit rates (a CF1 chain kept in canonical order)."""
    p = alpha.size
    if pat.name == "cf1":
        lam = np.append(rate, exitv[-1])
        alpha, lam = sort_cf1(alpha, lam)
        rate, exitv = lam[:-1].copy(), np.zeros(p)
        exitv[-1] = lam[-1]
    diag = -(np.asarray(np.bincount(pat.src, weights=rate, minlength=p), dtype=np.float64) + exitv)
    return Sparse(alpha, diag, pat.src, pat.dst, rate, exitv)


def rescale(s: Sparse, pat: Pattern, target_mean: float) -> Sparse:
    ph = to_ph(s, pat)
    c = ph.mean() / target_mean
    return Sparse(s.alpha, s.diag * c, s.src, s.dst, s.rate * c, s.exitv * c)


def pack(s: Sparse, pat: Pattern) -> FloatArray:
    parts = [s.rate, s.exitv[pat.has_exit]]
    if pat.free_alpha:
        parts.insert(0, s.alpha)
    return np.log(np.maximum(np.concatenate(parts), 1e-200))


def unpack(theta: FloatArray, s: Sparse, pat: Pattern) -> Sparse:
    p = s.alpha.size
    v = np.exp(np.clip(theta, -460.0, 460.0))
    k = 0
    alpha = s.alpha
    if pat.free_alpha:
        alpha = v[:p] / v[:p].sum()
        k = p
    ne = pat.src.size
    rate = v[k:k + ne]
    exitv = np.zeros(p)
    exitv[pat.has_exit] = v[k + ne:]
    if pat.branches:  # keep branch rates tied
        for br in pat.branches:
            b = np.array(br)
            inb = np.isin(pat.src, b)
            lam = np.exp(np.mean(np.log(np.append(rate[inb], exitv[b[-1]]))))
            rate[inb] = lam
            exitv[b[-1]] = lam
    return _assemble(pat, alpha, rate, exitv)


MAX_POISSON_TERMS = 2e6  # q * (largest sample): bounds the cost of one E-step


def valid(s: Sparse, span: float) -> bool:
    return bool(np.all(np.isfinite(s.rate)) and np.all(np.isfinite(s.exitv)) and np.all(s.diag < 0)
                and np.all(np.isfinite(s.alpha)) and s.exitv.sum() > 0 and abs(s.alpha.sum() - 1) < 1e-6
                and float(np.max(-s.diag)) * span < MAX_POISSON_TERMS)
