"""Model builders shared by the solver tests."""
from __future__ import annotations

import numpy as np

from overtake.mdp.model import Stage, TandemModel


def exp_stage(name: str, mean: float) -> Stage:
    return Stage(name, np.array([1.0]), np.array([[-1.0 / mean]]))


def h2_stage(name: str, r: float, m1: float, m2: float) -> Stage:
    return Stage(name, np.array([r, 1.0 - r]), np.diag([-1.0 / m1, -1.0 / m2]))


def tandem(load: float, *stages: Stage, **kw: object) -> TandemModel:
    work = sum(s.mean() for s in stages)
    return TandemModel(load / work, tuple(stages), **kw)  # type: ignore[arg-type]

