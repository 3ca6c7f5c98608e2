from __future__ import annotations

import pytest
from support.mdp_helpers import h2_stage, tandem

from overtake.mdp.model import TandemModel


@pytest.fixture
def case4() -> TandemModel:
    """van der Weij et al., "Dynamic thread assignment", Table 1, case 4: two H2 stages (r = 0.91, means 0.55/5.45), rho = 0.6."""
    return tandem(0.6, h2_stage("s1", 0.91, 0.55, 5.45), h2_stage("s2", 0.91, 0.55, 5.45))
