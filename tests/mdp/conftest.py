from __future__ import annotations

import pytest
from support.mdp_helpers import h2_stage, tandem

from overtake.mdp import observation_exact
from overtake.mdp.model import TandemModel


@pytest.fixture
def case4() -> TandemModel:
    """van der Weij et al., "Dynamic thread assignment", Table 1, case 4: two H2 stages (r = 0.91, means 0.55/5.45), rho = 0.6."""
    return tandem(0.6, h2_stage("s1", 0.91, 0.55, 5.45), h2_stage("s2", 0.91, 0.55, 5.45))


@pytest.fixture
def starved(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every iterative solve on a budget of one iteration (so it misses); its outcomes, in order."""
    monkeypatch.setattr(observation_exact, "DIRECT_STATES", 0)  # the iterative path on a small chain
    calls: list[bool] = []
    iterate = observation_exact.Factor.iterate

    def counted(self, A_, B_, X0, *, budget, trans=False):  # type: ignore[no-untyped-def]
        out = iterate(self, A_, B_, X0, budget=1, trans=trans)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(observation_exact.Factor, "iterate", counted)
    return calls
