"""The solver's defaults that the commands' options show, written out so that parsing the options
imports nothing of the solver (tests/mdp/test_mdp_exports.py checks them against the solver's own)."""

from __future__ import annotations

#: overtake.mdp.budget.DEFAULT_MAX_STATES
DEFAULT_MAX_STATES = 4_000_000
