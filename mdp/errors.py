"""Errors raised by :mod:`overtake.mdp`.

Hierarchy::

    OvertakeError (overtake.errors)
    └── MDPError
        ├── ModelError (ValueError)          invalid model or scenario input; names the field
        ├── TruncationError (ValueError)     a requested truncation is too small or too large
        ├── PolicyFileError (ValueError)     a policy artifact is corrupt or does not match the model
        └── SolverError                      a solver did not converge within its limits
"""

from __future__ import annotations

from overtake.errors import OvertakeError

__all__ = ["MDPError", "ModelError", "OvertakeError", "PolicyFileError", "SolverError", "TruncationError"]


class MDPError(OvertakeError):
    """Root of the solver package's errors."""


class ModelError(MDPError, ValueError):
    """The model or scenario is invalid; the message names the field, the value and the rule."""


class TruncationError(MDPError, ValueError):
    """The truncation cannot hold the model (cap too small, or the state space too large)."""


class PolicyFileError(MDPError, ValueError):
    """A policy artifact cannot be read or does not match the model it is used with."""


class SolverError(MDPError):
    """A solver stopped at its iteration limit without meeting its tolerance."""
