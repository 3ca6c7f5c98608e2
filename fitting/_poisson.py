"""Accuracy limits of the uniformization series, shared by the kernels and their callers."""

from __future__ import annotations

POISSON_EPS = 1e-13  # evaluation accuracy
MAX_STEP = 300.0  # largest q*dt between renormalisations (grids are refined to respect it)
EM_POISSON_EPS = 1e-10  # E-step: renormalised weights keep mass exact, direction error ~eps
